"""The appliance as an OPC UA client of the line's own servers (YAML `sources:`; docs/sources.md).

    node_ref.py    NodeIds by namespace URI (`nsu=URI;s=...`) and browse paths, parsed (never a namespace index)
    windows.py     a feed's rows and windows: alignment by SourceTimestamp, stride / trigger, data quality, gaps
    identity.py    what is kept per source under <state_dir>/pki/sources/<name>/ (client certificate, trust, password)
    specs.py       the configuration as the client process receives it
    protocol.py    the serve <-> client process messages (over the model workers' Channel)
    session.py     one connection: trusted certificate check, security, user, decode limits, resolving, reading
    client.py      one source's life in the client process: connect, subscribe, check, cut, reconnect with back-off
    process.py     the client process (`python -m appliance.sources.process`)
    supervisor.py  serve's side of that process: spawn, watch, restart, write-back requests

What a window's result does in the address space (Last, alarms, drift, Sources/<name>) is uaserver/sources.py;
`appliance sources ...` is appliance/cli/sources.py.
"""
