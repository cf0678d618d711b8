"""The appliance's namespace URI: the server registers it, the NodeSet2 export and `plc-types` name it."""

NAMESPACE_URI = "urn:opcua-inference-appliance"
