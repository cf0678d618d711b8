"""The language-model path of the engine: its entry is service.py (GenerativeModelService), which a worker builds
(appliance/workers/engine_factory.py); engine.py runs the loop, scheduler.py -> runner.py -> models/ do the steps."""
