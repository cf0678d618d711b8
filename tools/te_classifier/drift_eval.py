"""Evaluate drift detection on the held-out Tennessee Eastman test files (never used to build the reference).

    python -m tools.te_classifier.drift_eval [--window N] [--test psi|ks] [--threshold X] [--markdown]

Each dNN_te.dat is fed as a PLC would: one Infer call per process sample (every 3 minutes), carrying the window of
the last 20 samples, oldest row first. Detection delay: process samples from the fault onset (row 160) until State
first reads Drifting at or after the onset (a fault file's first 160 rows are normal operation). False alarms: the
share of decisions on d00_te.dat (normal operation, 960 rows) that read Drifting, and whether any did.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from appliance.drift import DriftDetector
from models.te_classifier import FAULT_ONSET_ROW, N_CLASSES, ONNX_PATH, WINDOW, load_te_rows, sliding_windows
from tools.te_classifier.drift_reference import DRIFT_REFERENCE_NAME

MINUTES_PER_SAMPLE = 3


def run_file(fault: int, session, settings: dict) -> dict:
    rows = load_te_rows(fault, test=True)
    x = sliding_windows(rows, WINDOW)
    probs = session.run(["probabilities"], {"input": x})[0]
    detector = DriftDetector.from_file(ONNX_PATH.with_name(DRIFT_REFERENCE_NAME), **settings)
    states, features = [], []
    for i in range(len(x)):
        status = detector.update(x[i:i + 1], probs[i:i + 1])
        states.append(status.state if detector.warm else "Warmup")
        features.append(status.feature)
    last_row = np.arange(WINDOW - 1, len(rows))  # the newest process row each call carries
    return {"states": np.array(states), "features": features, "last_row": last_row}


def evaluate(settings: dict) -> dict:
    import onnxruntime as ort

    session = ort.InferenceSession(str(ONNX_PATH), providers=["CPUExecutionProvider"])
    table = {}
    pre_onset_decisions = pre_onset_alarms = 0
    for fault in range(N_CLASSES):
        r = run_file(fault, session, settings)
        decided = r["states"] != "Warmup"
        drifting = r["states"] == "Drifting"
        if fault == 0:
            table[0] = {"decisions": int(decided.sum()), "false_alarm_rate": float(drifting[decided].mean()),
                        "any_alarm": bool(drifting.any())}
            continue
        after = (r["last_row"] >= FAULT_ONSET_ROW) & drifting
        before = (r["last_row"] < FAULT_ONSET_ROW) & drifting
        pre_onset_decisions += int(((r["last_row"] < FAULT_ONSET_ROW) & decided).sum())
        pre_onset_alarms += int(before.sum())
        hit = np.nonzero(after)[0]
        delay = int(r["last_row"][hit[0]] - FAULT_ONSET_ROW) if len(hit) else None
        table[fault] = {"delay_samples": delay, "feature": r["features"][hit[0]] if len(hit) else "",
                        "drifting_share_after_onset": float(after.sum() / (r["last_row"] >= FAULT_ONSET_ROW).sum()),
                        "alarm_before_onset": bool(before.any())}
    table[0]["pre_onset_decisions"], table[0]["pre_onset_alarms"] = pre_onset_decisions, pre_onset_alarms
    return table


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=100)
    ap.add_argument("--test", choices=["psi", "ks"], default="ks")
    ap.add_argument("--threshold", type=float, default=2.0)
    ap.add_argument("--adwin-delta", type=float, default=0.002)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    settings = {"window": args.window, "test": args.test, "threshold": args.threshold,
                "adwin_delta": args.adwin_delta}
    started = time.monotonic()
    table = evaluate(settings)
    normal = table[0]
    detected = [f for f in range(1, N_CLASSES) if table[f]["delay_samples"] is not None]
    print(f"settings {settings}; {time.monotonic() - started:.1f} s")
    print(f"normal operation (d00_te.dat): {normal['decisions']} decisions, false-alarm rate "
          f"{normal['false_alarm_rate']:.3f}, any alarm: {normal['any_alarm']}; normal rows before the onsets of the "
          f"fault files: {normal['pre_onset_alarms']} of {normal['pre_onset_decisions']} decisions Drifting")
    print(f"faults detected: {len(detected)} of {N_CLASSES - 1}")
    if args.markdown:
        print("\n| fault | delay (samples) | delay (h) | first drifting feature | share of post-onset calls Drifting "
              "| Drifting before the onset |")
        print("|---:|---:|---:|---|---:|---|")
    for f in range(1, N_CLASSES):
        e = table[f]
        d = e["delay_samples"]
        hours = f"{d * MINUTES_PER_SAMPLE / 60:.1f}" if d is not None else "-"
        if args.markdown:
            print(f"| {f} | {d if d is not None else 'not detected'} | {hours} | {e['feature'] or '-'} | "
                  f"{e['drifting_share_after_onset']:.2f} | {'yes' if e['alarm_before_onset'] else 'no'} |")
        else:
            print(f"  fault {f:2d}: delay {str(d):>5} samples ({hours} h)  feature {e['feature']:12s} "
                  f"drifting {e['drifting_share_after_onset']:.2f}  alarm before onset {e['alarm_before_onset']}")


if __name__ == "__main__":
    main()
