"""Train the Tennessee Eastman fault classifier and write the shipped artifacts.

    python -m tools.te_classifier.train [--out DIR] [--seed N] [--threads N]

Writes te_classifier.onnx, te_classifier.pt2 (torch.export ExportedProgram), metrics.json and te_classifier.drift.json into --out (default: this package) and
prints the evaluation. Fitting uses the dNN.dat training files only; the held-out dNN_te.dat files give the reported
metrics and are never used to fit or tune anything.
"""
from __future__ import annotations

import argparse
import json
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from models.te_classifier import (
    CLASS_NAMES, HARD_FAULTS, MODEL_DIR, N_CLASSES, N_VARIABLES, WINDOW, load_te_rows, load_te_test_windows,
    load_te_train_windows)
from tools.te_classifier.drift_reference import write_drift_reference

OPSET = 17


@dataclass
class TrainConfig:
    window: int = WINDOW
    arch: str = "conv"  # conv | mlp (flattened window; with window=1 the single-row baseline)
    hidden: int = 64
    epochs: int = 20
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 1e-4
    dropout: float = 0.2
    # Augmentations, in units of the normal-operation std: white noise per value, and one level shift per window and
    # variable (the test runs sit up to ~0.5 std away from the training run's levels).
    noise_std: float = 0.3
    offset_std: float = 0.3
    normal_weight: float = 5.0  # loss weight of class 0
    val_fraction: float = 0.25  # tail of each training file held out to choose the normal-operation bias
    target_false_alarm: float = 0.05  # that bias is the smallest keeping held-out normal alarms at or below this
    seed: int = 0
    threads: int = 1


class TEClassifier(nn.Module):
    """Raw (B, W, 52) process values -> (B, 22) probabilities; the normalisation travels inside the graph."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, body: nn.Module):
        super().__init__()
        self.register_buffer("mean", mean.reshape(1, 1, -1).float())
        self.register_buffer("std", std.reshape(1, 1, -1).float())
        # Added to the logits after fitting; only class 0 is non-zero (the normal-operation prior, see README).
        self.register_buffer("class_bias", torch.zeros(N_CLASSES))
        self.body = body

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.body((x - self.mean) / self.std) + self.class_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.logits(x), dim=-1)


class ConvBody(nn.Module):
    """Two 1-D convolutions over time (the 52 variables are channels), then mean and max pooled over time."""

    def __init__(self, hidden: int, dropout: float):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(N_VARIABLES, hidden, kernel_size=3, padding=1), nn.ReLU(),
            nn.Conv1d(hidden, hidden, kernel_size=3, padding=1), nn.ReLU())
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(2 * hidden, N_CLASSES))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv(z.transpose(1, 2))  # (B, hidden, W)
        return self.head(torch.cat([h.mean(dim=2), h.amax(dim=2)], dim=1))


def mlp_body(window: int, hidden: int, dropout: float) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(window * N_VARIABLES, hidden), nn.ReLU(), nn.Dropout(dropout),
        nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, N_CLASSES))


def normal_operation_stats() -> tuple[np.ndarray, np.ndarray]:
    """Per-variable mean and std of the normal-operation training file d00.dat: inputs are then in 'sigmas of normal
    operation', the usual scaling in process monitoring."""
    rows = load_te_rows(0, test=False).astype(np.float64)
    return rows.mean(axis=0).astype(np.float32), np.maximum(rows.std(axis=0), 1e-6).astype(np.float32)


def training_windows(window: int, val_fraction: float = 0.0):
    """(x, y, val_x, val_y) from the training files; with val_fraction > 0 the last part of each file (in time) is
    held out, and the `window` windows before it are skipped so no held-out row is ever trained on."""
    parts: tuple[list, list, list, list] = ([], [], [], [])
    for fault in range(N_CLASSES):
        x, y = load_te_train_windows(fault, window)
        cut = int(round(len(x) * (1 - val_fraction)))
        train_end = cut - window if val_fraction else cut
        for part, value in zip(parts, (x[:train_end], y[:train_end], x[cut:], y[cut:])):
            part.append(value)
    return tuple(np.concatenate(p) for p in parts)


def fit(cfg: TrainConfig, x: np.ndarray, y: np.ndarray, mean: np.ndarray, std: np.ndarray) -> TEClassifier:
    torch.manual_seed(cfg.seed)
    torch.use_deterministic_algorithms(True)
    body = ConvBody(cfg.hidden, cfg.dropout) if cfg.arch == "conv" else mlp_body(cfg.window, cfg.hidden, cfg.dropout)
    model = TEClassifier(torch.from_numpy(mean), torch.from_numpy(std), body)
    rng = np.random.default_rng(cfg.seed)
    class_weights = torch.ones(N_CLASSES)
    class_weights[0] = cfg.normal_weight
    loss_fn = nn.CrossEntropyLoss(weight=class_weights)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = cfg.epochs * ((len(x) + cfg.batch_size - 1) // cfg.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=steps)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    noise_scale, offset_scale = model.std * cfg.noise_std, model.std * cfg.offset_std  # in raw units
    model.train()
    for _ in range(cfg.epochs):
        order = torch.from_numpy(rng.permutation(len(x)))
        for start in range(0, len(x), cfg.batch_size):
            idx = order[start:start + cfg.batch_size]
            xb = xt[idx] + torch.randn(len(idx), cfg.window, N_VARIABLES) * noise_scale
            xb = xb + torch.randn(len(idx), 1, N_VARIABLES) * offset_scale
            loss = loss_fn(model.logits(xb), yt[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return model.eval()


@torch.no_grad()
def choose_normal_bias(model: TEClassifier, vx: np.ndarray, vy: np.ndarray, target: float) -> float:
    """Smallest class-0 logit bias at which at most `target` of the held-out normal windows raise an alarm."""
    logits = model.logits(torch.from_numpy(vx[vy == 0]))
    for bias in np.arange(0.0, 20.01, 0.25):
        shifted = logits.clone()
        shifted[:, 0] += float(bias)
        if (shifted.argmax(dim=1) != 0).float().mean().item() <= target:
            return float(bias)
    return 20.0


def evaluate(predict_fn, window: int = WINDOW) -> dict:
    """Metrics on the held-out dNN_te.dat files. predict_fn: raw windows (n, W, 52) -> predicted class ids (n,)."""
    y_all, p_all, per_file = [], [], {}
    for fault in range(N_CLASSES):
        x, y = load_te_test_windows(fault, window)
        p = predict_fn(x)
        y_all.append(y), p_all.append(p)
        per_file[f"d{fault:02d}_te"] = {"windows": int(len(y)), "accuracy": float((p == y).mean())}
    y, p = np.concatenate(y_all), np.concatenate(p_all)
    per_class = {}
    for c in range(N_CLASSES):
        mask = y == c
        entry = {"name": CLASS_NAMES[c], "windows": int(mask.sum()), "recall": float((p[mask] == c).mean())}
        key = "false_alarm_rate" if c == 0 else "detection_rate"  # normal seen as a fault / fault seen as any fault
        entry[key] = float((p[mask] != 0).mean())
        per_class[str(c)] = entry
    easy = ~np.isin(y, HARD_FAULTS)
    confusion = np.zeros((N_CLASSES, N_CLASSES), dtype=np.int64)
    np.add.at(confusion, (y, p), 1)
    return {
        "accuracy": float((p == y).mean()),
        "accuracy_without_faults_3_9_15": float((p[easy] == y[easy]).mean()),
        "fault_detection_rate": float((p[y != 0] != 0).mean()),
        "false_alarm_rate": per_class["0"]["false_alarm_rate"],
        "windows": int(len(y)),
        "per_class": per_class,
        "per_test_file": per_file,
        "confusion": confusion.tolist(),  # rows: true class, columns: predicted class
    }


def export(model: TEClassifier, out: Path, window: int) -> tuple[Path, Path]:
    """ONNX (opset 17, dynamic batch, input 'input', output 'probabilities') and a torch.export ExportedProgram
    (.pt2, dynamic batch) of the same model. TorchScript is retired (deprecated in torch 2.13)."""
    out.mkdir(parents=True, exist_ok=True)
    onnx_path, ts_path = out / "te_classifier.onnx", out / "te_classifier.pt2"
    example = torch.zeros(2, window, N_VARIABLES)
    # The TorchScript-based exporter: needs no onnxscript (not installed) and writes one self-contained file.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(model, (example,), str(onnx_path), dynamo=False, opset_version=OPSET,
                          input_names=["input"], output_names=["probabilities"],
                          dynamic_axes={"input": {0: "batch"}, "probabilities": {0: "batch"}})
    save_exported(model, ts_path, window)
    return onnx_path, ts_path


def save_exported(model: TEClassifier, path: Path, window: int) -> Path:
    """torch.export with a dynamic batch dimension (1..65536 windows), saved with torch.export.save."""
    model.eval()
    batch = torch.export.Dim("batch", min=1, max=65536)
    program = torch.export.export(model, (torch.zeros(2, window, N_VARIABLES),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))
    return path


def onnx_session(onnx_path: Path):
    import onnxruntime as ort

    return ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])


def export_max_diff(model: TEClassifier, onnx_path: Path, ts_path: Path, x: np.ndarray) -> float:
    """Largest abs difference of the probabilities between torch, ONNX (onnxruntime) and the ExportedProgram."""
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
        scripted = torch.export.load(str(ts_path)).module()(torch.from_numpy(x)).numpy()
    onnx_out = onnx_session(onnx_path).run(["probabilities"], {"input": x})[0]
    return float(max(np.abs(ref - onnx_out).max(), np.abs(ref - scripted).max(), np.abs(onnx_out - scripted).max()))


def train(cfg: TrainConfig) -> tuple[TEClassifier, dict]:
    """Fit on 75% of each training file to choose the normal bias, then refit on all of it and apply that bias."""
    mean, std = normal_operation_stats()
    x, y, vx, vy = training_windows(cfg.window, cfg.val_fraction)
    held_out_model = fit(cfg, x, y, mean, std)
    bias = choose_normal_bias(held_out_model, vx, vy, cfg.target_false_alarm)
    held_out_model.class_bias[0] = bias
    with torch.no_grad():
        val_acc = float((held_out_model(torch.from_numpy(vx)).argmax(dim=1).numpy() == vy).mean())
    x, y, _, _ = training_windows(cfg.window)
    model = fit(cfg, x, y, mean, std)
    model.class_bias[0] = bias
    return model, {"normal_bias": bias, "validation_accuracy": val_acc, "train_windows": int(len(x))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=MODEL_DIR, help="folder for the artifacts (default: this package)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the build machine is shared)")
    args = ap.parse_args(argv)
    cfg = TrainConfig(seed=args.seed, threads=args.threads)
    torch.set_num_threads(cfg.threads)

    started = time.monotonic()
    model, fit_info = train(cfg)
    train_s = time.monotonic() - started
    onnx_path, ts_path = export(model, args.out, cfg.window)
    probe = np.concatenate([load_te_test_windows(f, cfg.window)[0][::40] for f in range(N_CLASSES)])
    max_diff = export_max_diff(model, onnx_path, ts_path, probe)
    if max_diff >= 1e-5:
        raise SystemExit(f"exports disagree with the torch model: max abs diff {max_diff:.2e}")

    session = onnx_session(onnx_path)  # the shipped graph is what is measured
    metrics = evaluate(lambda x: session.run(["probabilities"], {"input": x})[0].argmax(axis=1), cfg.window)
    metrics.update({
        "model": "te_classifier", "input_shape": [cfg.window, N_VARIABLES], "output_shape": [N_CLASSES],
        "class_names": CLASS_NAMES, **fit_info, "train_seconds": round(train_s, 1),
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "export_max_abs_diff": max_diff, "config": asdict(cfg),
        "test_window_labels": "windows of dNN_te.dat whose rows are all < 160 are class 0, all >= 160 the file's "
                              "fault; windows straddling row 160 are dropped",
    })
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    write_drift_reference(onnx_path, args.out)  # the drift reference of this graph
    print(f"trained in {train_s:.1f} s on {fit_info['train_windows']} windows; normal bias {fit_info['normal_bias']};"
          f" export max abs diff {max_diff:.1e}")
    print(f"test accuracy {metrics['accuracy']:.3f} (without 3/9/15: {metrics['accuracy_without_faults_3_9_15']:.3f})"
          f", fault detection {metrics['fault_detection_rate']:.3f}, false alarms {metrics['false_alarm_rate']:.3f}")
    for c, entry in metrics["per_class"].items():
        rate = entry.get("detection_rate", entry.get("false_alarm_rate"))
        print(f"  {int(c):2d} {entry['name'][:44]:44s} recall {entry['recall']:.3f}  "
              f"{'detection' if int(c) else 'false alarm'} {rate:.3f}")


if __name__ == "__main__":
    main()
