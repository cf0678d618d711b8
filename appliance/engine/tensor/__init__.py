"""The tensor path of the engine: its entry is service.py (TensorModelService), which a worker builds
(appliance/workers/engine_factory.py); batcher.py groups calls, backends.py runs them (ONNX Runtime, torch.export,
TensorRT)."""
