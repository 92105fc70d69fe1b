"""sage-qual: a production wrapper and qualification suite for SageAttention 2.x.

    import sage_qual
    sage_qual.install()                      # once, at startup; never raises
    with sage_qual.sage_attention_scope() as report:
        image = pipeline(...)                # eligible SDPA calls run on SageAttention
    print(report.summary())

Importing this package imports neither sageattention nor triton, nor torch: the public names are
loaded on first use (PEP 562), so `sage-qual --version`, the CLI and the report and gate modules
start without the wrapper.
"""

import importlib

from sage_qual.version import __version__

# Public name -> the module that defines it.
_PUBLIC = {
    "AuditConfig": "sage_qual.serving.config",
    "audit_tally": "sage_qual.serving.audit",
    "DEFAULT_CONFIG": "sage_qual.serving.config",
    "WrapperConfig": "sage_qual.serving.config",
    "ScopeReport": "sage_qual.serving.scope",
    "sage_attention_scope": "sage_qual.serving.scope",
    "InstallStatus": "sage_qual.serving.wrapper",
    "install": "sage_qual.serving.wrapper",
    "install_status": "sage_qual.serving.wrapper",
    "uninstall": "sage_qual.serving.wrapper",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'sage_qual' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
