"""The appliance's certificates: CA, server and client certificates, trust list, CRL and validation."""
from .pki import PKI
from .records import CertEntry, IssuedCert, PKIError, RevokedCert
from .rolemap import ROLES
from .validate import TrustList, ValidationResult

__all__ = ["PKI", "PKIError", "IssuedCert", "CertEntry", "RevokedCert", "TrustList", "ValidationResult", "ROLES"]
