"""Model worker processes: each model (or YAML group of models) runs in its own process, started and supervised by
the `serve` process, which keeps OPC UA, PKI, audit and monitoring.

    protocol.py    the messages and their framing (the one module that knows the transport)
    worker.py      the worker process: hosts the engine services of its models, answers liveness checks
    supervisor.py  the serve side: spawns, pings, kills and restarts a worker with back-off
    remote.py      the serve side's model objects (core.model_port), calls over the protocol
    trial.py       one model loaded once in a worker of its own: the check before a deployed version is switched in
"""
