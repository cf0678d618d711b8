"""What the appliance's rooms share, beneath both: appliance/ (the daemon, engine, workers, CLI) and uaserver/ (the
OPC UA server) import core/, and core/ imports neither (tests/test_import_rules.py). It holds the configuration
(config/: schema, rules, checks, read in this one place), the contract's methods and ObjectTypes
(method_arguments.py, object_types.py), the model port through which the server reaches a model, the error types and
their status codes, the audit digest, the correlation id, the namespace URI, and the typed bundle of domain services
the daemon builds and hands to the server (services.py)."""
