"""sage-qual: a production wrapper and qualification suite for SageAttention 2.x.

    import sage_qual
    sage_qual.install()                      # once, at startup; never raises
    with sage_qual.sage_attention_scope() as report:
        image = pipeline(...)                # eligible SDPA calls run on SageAttention
    print(report.summary())

Importing this package imports neither sageattention nor triton.
"""

from .config import DEFAULT_CONFIG, WrapperConfig
from .scope import ScopeReport, sage_attention_scope
from .wrapper import InstallStatus, install, install_status, uninstall

__version__ = "0.1.0"
__all__ = [
    "DEFAULT_CONFIG",
    "InstallStatus",
    "ScopeReport",
    "WrapperConfig",
    "install",
    "install_status",
    "sage_attention_scope",
    "uninstall",
]
