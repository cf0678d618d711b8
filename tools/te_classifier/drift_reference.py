"""Write te_classifier.drift.json: the drift reference statistics of the shipped classifier, from its training data.

    python -m tools.te_classifier.drift_reference [--out DIR]

No retraining: the committed ONNX graph is only run. The reference is normal operation as the model learned it: the
per-variable distribution of the normal-operation training file d00.dat (the newest row of each of its windows, i.e.
every process sample once) and the classes and confidences the shipped graph answers on those windows; the class
distribution of all training windows is stored beside it. `train.py` calls `write_drift_reference` after export.
"""
from __future__ import annotations

import argparse
from pathlib import Path


from appliance.drift import sample_features
from appliance.drift_reference import build_reference, write_reference
from models.te_classifier import INPUT_SHAPE, MODEL_DIR, N_CLASSES, ONNX_PATH, load_te_train_windows

# Column order of the Braatz .dat files: XMEAS(1..41), then XMV(1..11)
FEATURE_NAMES = [f"XMEAS({i})" for i in range(1, 42)] + [f"XMV({i})" for i in range(1, 12)]
DRIFT_REFERENCE_NAME = "te_classifier.drift.json"


def write_drift_reference(onnx_path: Path = ONNX_PATH, out: Path | None = None) -> Path:
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    x, _ = load_te_train_windows(0)
    probs = session.run(["probabilities"], {"input": x})[0]
    runs = [load_te_train_windows(fault)[0] for fault in range(N_CLASSES)]
    class_counts = [len(run) for run in runs]
    reference = build_reference(
        sample_features(x, list(INPUT_SHAPE)), FEATURE_NAMES, probs, list(INPUT_SHAPE), model_file=onnx_path,
        class_counts=class_counts, other_runs=[sample_features(run, list(INPUT_SHAPE)) for run in runs[1:]],
        source="d00.dat (normal operation, training file of the Braatz TE data in bibmon==1.2.0)")
    target = (out or onnx_path.parent) / DRIFT_REFERENCE_NAME
    write_reference(reference, target)
    return target


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=MODEL_DIR)
    args = ap.parse_args(argv)
    print(f"wrote {write_drift_reference(out=args.out)}")


if __name__ == "__main__":
    main()
