"""The appliance's own alarms (not a model's class alarms or drift): the Booleans its supervision computes
(appliance/supervision.py), its address space publishes under Objects/Appliance/Alarms, the NodeSet2 export declares
(appliance/nodeset_export.py), and the configuration check keeps models' labels and sources from taking
(core/config/checks.py). Named here once."""

DAEMON_ALARMS = ("EngineFault", "WorkerRestarting", "ModelFailed", "GpuWarning", "GpuCritical", "AuditLogFailed",
                 "AuditLogTorn")
