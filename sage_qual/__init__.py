"""sage-qual: a production wrapper and qualification suite for SageAttention 2.x.

    import sage_qual
    sage_qual.install()                      # once, at startup; never raises
    with sage_qual.sage_attention_scope() as report:
        image = pipeline(...)                # eligible SDPA calls run on SageAttention
    print(report.summary())

Importing this package imports neither sageattention nor triton.
"""

from sage_qual.serving.config import DEFAULT_CONFIG, WrapperConfig
from sage_qual.serving.scope import ScopeReport, sage_attention_scope
from sage_qual.serving.wrapper import InstallStatus, install, install_status, uninstall
from sage_qual.version import __version__

__all__ = [
    "__version__",
    "DEFAULT_CONFIG",
    "InstallStatus",
    "ScopeReport",
    "WrapperConfig",
    "install",
    "install_status",
    "sage_attention_scope",
    "uninstall",
]
