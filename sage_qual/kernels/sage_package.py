"""Find, import and vet the installed package of a kernel provider (`providers`: thu-ml's
`sageattention`, comfy-kitchen's `comfy_kitchen`).

`load(provider)` returns its kernel module with its version and which compiled extensions import,
or raises `SageUnavailable` whose message names the cause and the fix; `load_all()` tries every
provider. Nothing here touches a GPU.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from packaging.version import InvalidVersion, Version

from sage_qual.kernels.providers import PROVIDERS, THU_ML, Provider
from sage_qual.kernels.variants import Variant

BUILD_HINT = THU_ML.install_hint


class SageUnavailable(Exception):
    """A provider's kernels cannot serve; the message says why and what to do."""


@dataclass(frozen=True)
class SagePackage:
    module: ModuleType  # its kernels module (`Provider.kernels_module`)
    version: str
    extensions: frozenset[str]  # compiled extensions that import
    extension_errors: dict[str, str]  # the others, with the import error
    source: str = ""  # `source_digest()` of its Python and extension files ("" where none, a fake's)
    origin: str = ""  # `origin()`: the commit or wheel it was installed from, "" where unknown
    provider: str = THU_ML.name

    def kernel(self, variant: Variant):
        return getattr(self.module, variant.function)


def has_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def parse_version(text: str, provider: Provider = THU_ML) -> Version:
    """Version of a build, local labels such as `+cu130torch2.10.0andhigher.post6` included."""
    try:
        return Version(text)
    except InvalidVersion:
        raise SageUnavailable(f"{provider.distribution} reports version {text!r}, which is not a version "
                              f"number; reinstall it: {provider.install_hint}") from None


def check_version(text: str, provider: Provider = THU_ML) -> None:
    version = parse_version(text, provider)
    if version.major < 2 and provider.major_1_is:
        raise SageUnavailable(f"{provider.distribution} {text} is {provider.major_1_is}: uninstall it and "
                              f"{provider.install_hint}")
    if Version(version.base_version) < Version(provider.min_version):
        raise SageUnavailable(f"{provider.distribution} {text} is older than {provider.min_version}: "
                              f"{provider.install_hint}")


def source_digest(module: ModuleType, extensions: Iterable[ModuleType] = ()) -> str:
    """"sha256:" and the first 16 hex digits of the package's Python files (paths and bytes) and of
    its compiled `extensions`' files: one version string covers builds that dispatch differently
    (issue 27: thu-ml's 2.2.0, the woct0rdho fork, an older source), and their files tell them apart
    where the version does not. A rebuild with another compiler or CUDA changes the binaries, so it
    changes the digest too. "" for a module without files (a fake's)."""
    if not getattr(module, "__file__", None):
        return ""
    root = Path(module.__file__).parent
    digest = hashlib.sha256()
    files = [(path.relative_to(root).as_posix(), path) for path in sorted(root.rglob("*.py"))]
    files += sorted((extension.__name__, Path(extension.__file__)) for extension in extensions
                    if getattr(extension, "__file__", None) and Path(extension.__file__).is_file())
    for name, path in files:
        stat = path.stat()
        digest.update(name.encode() + b"\0" + _file_digest(path, stat.st_size, stat.st_mtime_ns))
    return "sha256:" + digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _file_digest(path: Path, size: int, mtime_ns: int) -> bytes:
    """One file's sha256, kept per (path, size, mtime) for the process: install() then reads each
    extension's binary (tens of MB) once, however many times the package is loaded."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.digest()


def origin(distribution: importlib.metadata.Distribution) -> str:
    """Where the installed package came from, as pip records it (PEP 610's direct_url.json, the
    wheel's WHEEL file): "git <url>@<commit>", "wheel <file name>", "wheel <tags>" or
    "local <folder>"; "" where nothing says (`setup.py install`, the way thu-ml's README builds it,
    records neither). A digest of the files tells builds apart; this says which one to rebuild."""
    try:
        direct = json.loads(distribution.read_text("direct_url.json") or "{}")
    except ValueError:
        direct = {}
    direct = direct if isinstance(direct, dict) else {}
    url, vcs = direct.get("url") or "", direct.get("vcs_info")
    if url and isinstance(vcs, dict) and vcs.get("commit_id"):
        return f"{vcs.get('vcs', 'vcs')} {url}@{vcs['commit_id']}"
    if url and "dir_info" in direct:
        return f"local {url.removeprefix('file://')}"
    if url:
        return f"wheel {url.rsplit('/', 1)[-1]}"
    tags = [line.split(":", 1)[1].strip() for line in (distribution.read_text("WHEEL") or "").splitlines()
            if line.startswith("Tag:")]
    return f"wheel {', '.join(tags)}" if tags else ""


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def absent(provider: Provider) -> str:
    """How `load` begins its refusal when the provider's package is not there at all (`sage-qual env`
    tells that apart from a package that is there but cannot serve)."""
    return f"{provider.distribution} is not installed"


def load(provider: Provider = THU_ML) -> SagePackage:
    name, hint = provider.distribution, provider.install_hint
    if not _installed(provider.package):
        raise SageUnavailable(f"{absent(provider)}: {hint}")
    if provider.needs_triton and not has_triton():
        raise SageUnavailable(f"triton is not installed; {name} needs it: pip install triton "
                              "(triton-windows on Windows)")
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        raise SageUnavailable(f"{name} imports but has no package metadata, so its version is unknown "
                              f"(a source folder on sys.path?): install it properly: {hint}") from None
    check_version(version, provider)
    try:
        module = importlib.import_module(provider.kernels_module)
    except Exception as error:  # a DLL load failure is an OSError, an ABI mismatch an ImportError
        raise SageUnavailable(f"importing {name} {version} failed: {type(error).__name__}: {error}; "
                              f"it was probably built for another torch or CUDA: {hint}") from None
    extensions, errors = {}, {}
    for extension in provider.extensions:
        try:
            extensions[extension] = importlib.import_module(f"{provider.package}.{extension}")
        except Exception as error:
            errors[extension] = f"{type(error).__name__}: {error}"
    return SagePackage(module, version, frozenset(extensions), errors,
                       source_digest(module, extensions.values()),
                       origin(importlib.metadata.distribution(name)), provider.name)


def load_all() -> dict[str, SagePackage | str]:
    """Every provider's package, or why it cannot serve (the SageUnavailable message)."""
    loaded: dict[str, SagePackage | str] = {}
    for provider in PROVIDERS.values():
        try:
            loaded[provider.name] = load(provider)
        except SageUnavailable as why:
            loaded[provider.name] = str(why)
    return loaded


def other_builds(packages: dict[str, SagePackage | str], beside: SagePackage) -> dict[str, str]:
    """The build (`source_digest`) of every provider of `packages` that loaded but `beside`'s: what
    binds a profile entry besides sageattention's version and build."""
    return {p.provider: p.source for p in packages.values()
            if not isinstance(p, str) and p.provider != beside.provider}


def kernel_problem(package: SagePackage, variant: Variant) -> str | None:
    """Why the package's function for `variant` cannot be called safely, or None.

    Every real kernel ends in **kwargs, so a keyword it no longer names (say a renamed `smooth_k`)
    would be swallowed and smoothing would silently come back on: require each one by name.
    """
    provider = PROVIDERS[package.provider]
    function = getattr(package.module, variant.function, None)
    if function is None:
        return f"{provider.distribution} {package.version} has no {variant.function}: {provider.install_hint}"
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError) as error:
        return f"cannot read the signature of {variant.function}: {error}"
    named = {n for n, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    missing = sorted(set(variant.call_keywords(1.0)) - named)
    if missing:
        return (f"{variant.function} in {provider.distribution} {package.version} does not take "
                f"{', '.join(missing)} by name; a **kwargs would swallow it (smooth_k=False would be "
                f"ignored): use a build whose kernels name these keywords")
    return None
