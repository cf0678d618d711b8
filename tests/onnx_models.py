"""Small ONNX graphs written at test time (nothing binary is committed for tests)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _save(graph, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def affine_model(path: Path, width: int = 4, scale: float = 2.0, offset: float = 1.0) -> Path:
    """y = x * scale + offset, one sample = `width` floats."""
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", width])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", width])
    inits = [numpy_helper.from_array(np.array(scale, np.float32), "scale"),
             numpy_helper.from_array(np.array(offset, np.float32), "offset")]
    nodes = [helper.make_node("Mul", ["input", "scale"], ["scaled"]),
             helper.make_node("Add", ["scaled", "offset"], ["output"])]
    return _save(helper.make_graph(nodes, "affine", [x], [y], inits), path)


def log_model(path: Path, width: int = 4) -> Path:
    """y = log(x): a negative input yields NaN, which the appliance must never hand to a PLC."""
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", width])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", width])
    return _save(helper.make_graph([helper.make_node("Log", ["input"], ["output"])], "log", [x], [y]), path)


def heavy_model(path: Path, width: int = 4, size: int = 2048, products: int = 8) -> Path:
    """y = x + mean(W @ W @ ... ) * 0: correct shapes, but each batch costs `products` dense size x size matrix
    products (a few hundred ms per batch even with AMX), so deadlines and full queues can be reached on purpose."""
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", width])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", width])
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((size, size)) / np.sqrt(size)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
    # the first factor depends on the input, so nothing can be constant-folded at load
    nodes, prev = [helper.make_node("ReduceSum", ["input"], ["s"], keepdims=0),
                   helper.make_node("Mul", ["W", "s"], ["Ws"])], "Ws"
    for i in range(products):
        nodes.append(helper.make_node("MatMul", [prev, "W"], [f"p{i}"]))
        prev = f"p{i}"
    nodes += [helper.make_node("ReduceMean", [prev], ["m"], keepdims=0),
              helper.make_node("Mul", ["m", "zero"], ["z"]),
              helper.make_node("Add", ["input", "z"], ["output"])]
    return _save(helper.make_graph(nodes, "heavy", [x], [y], inits), path)


def hang_model(path: Path, width: int = 4) -> Path:
    """y = x, but an input whose largest value is v runs an ONNX Loop of v * 1e12 iterations first: a forward pass
    that never returns (the load-time probe with zeros runs none)."""
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", width])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", width])
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Add", ["v_in", "one"], ["v_out"])], "spin",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.array(1.0, np.float32), "one")])
    inits = [numpy_helper.from_array(np.array(1e12, np.float32), "scale"),
             numpy_helper.from_array(np.array(True), "true"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
    nodes = [helper.make_node("ReduceMax", ["input"], ["m"], keepdims=0),
             helper.make_node("Mul", ["m", "scale"], ["ms"]),
             helper.make_node("Cast", ["ms"], ["trips"], to=TensorProto.INT64),
             helper.make_node("Loop", ["trips", "true", "zero"], ["v"], body=body),
             helper.make_node("Mul", ["v", "zero"], ["vz"]),
             helper.make_node("Add", ["input", "vz"], ["output"])]
    return _save(helper.make_graph(nodes, "hang", [x], [y], inits), path)


def memory_hog_model(path: Path, width: int = 4, bytes_per_unit: int = 3 << 30) -> Path:
    """y = x, but an input whose largest value is v first fills a tensor of v * bytes_per_unit bytes (pages
    touched, so resident): a model that allocates past a worker's memory limit (the probe with zeros: none)."""
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", width])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", width])
    inits = [numpy_helper.from_array(np.array(bytes_per_unit // 4, np.float32), "scale"),
             numpy_helper.from_array(np.array([1], np.int64), "one_dim"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
    nodes = [helper.make_node("ReduceMax", ["input"], ["m"], keepdims=0),
             helper.make_node("Mul", ["m", "scale"], ["ms"]),
             helper.make_node("Cast", ["ms"], ["n"], to=TensorProto.INT64),
             helper.make_node("Reshape", ["n", "one_dim"], ["shape"]),
             helper.make_node("ConstantOfShape", ["shape"], ["big"],
                              value=numpy_helper.from_array(np.array([1.0], np.float32))),
             helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0),
             helper.make_node("Mul", ["s", "zero"], ["sz"]),
             helper.make_node("Add", ["input", "sz"], ["output"])]
    return _save(helper.make_graph(nodes, "hog", [x], [y], inits), path)
