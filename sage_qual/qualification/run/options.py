"""What a certify run is given (`RunRequest`: its subject, its executor, the families and fixtures),
and its checks: torch-free, so the command line refuses a bad number before it imports torch (1.6 s
here) and before any worker starts or any file is written."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import sys
from pathlib import Path

from sage_qual import limits
from sage_qual.errors import UsageError
from sage_qual.qualification import names

# The longest --timeout taken: an hour without a result is a hang by any measure (the slowest task
# measured took 8.6 s, docs/results/run2-h200-certify-full/report.json.gz).
MAX_TIMEOUT_S = 3600.0


@dataclasses.dataclass(frozen=True)
class Variants:
    """The subject of `certify`: our variants (None: every one in the registry)."""
    names: list[str] | None = None


@dataclasses.dataclass(frozen=True)
class Integration:
    """The subject of `certify --target`: an app's integration (`targets.resolve` takes the name)."""
    target: str


@dataclasses.dataclass(frozen=True)
class Workers:
    """Run in isolated worker processes on the GPUs `devices` names, each task given `timeout` s."""
    devices: str = "all"
    timeout: float = limits.TASK_TIMEOUT


@dataclasses.dataclass(frozen=True)
class InProcess:
    """Run in this process with each variant's numerics model as its kernel (`certify --emulate`)."""


# The names a run writes into its --out folder (plots per device and per figure, the workers' logs).
RUN_OUTPUTS = ("report.json", "report.md", "report.html", "profile.json", "accuracy-*.png", "speedup-*.png",
               "logs")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunRequest:
    """What a certify run is asked: what it qualifies, where it runs, on which families and fixtures."""
    out: Path
    subject: Variants | Integration = Variants()
    executor: Workers | InProcess = Workers()
    families: list[str] | None = None
    fixture_dirs: list[str] | None = None
    quick: bool = False
    junit_xml: Path | None = None  # also write JUnit XML, one test case per GPU model and family
    command: str = "sage_qual.qualification.run.run.certify()"
    force: bool = False  # replace a previous run's report in `out`

    def check(self) -> None:
        """UsageError for a request that cannot run, before torch is imported or a file is written."""
        check_out(Path(self.out))
        previous = self.previous_run()
        if previous and not self.force:
            # Its plots, logs and profile would mix with this run's: a person asks for that by name.
            raise UsageError(f"{Path(self.out) / 'report.json'} is a previous run's report: give another "
                             "--out, or --force to replace that run")
        names.select_families(self.families)
        if isinstance(self.subject, Variants):
            names.select_variants(self.subject.names)
        if isinstance(self.executor, InProcess):
            if isinstance(self.subject, Integration):
                raise UsageError("--target qualifies one integration on a GPU: leave out --emulate")
            if self.junit_xml:  # a CI job reads JUnit as decided; a prediction decides nothing
                raise UsageError("--emulate only predicts, and --junit-xml records decisions: leave out "
                                 "--junit-xml")
            return
        check_numbers(self.executor.timeout, self.executor.devices)

    def previous_run(self) -> list[Path]:
        """What a previous run left in `out` under the names a run writes (`RUN_OUTPUTS`): what
        --force removes, so that no plot or profile of that run stays beside this run's report.
        UsageError for one that is a symbolic link (a run writes inside `out` only) or that is not
        what a run writes there (a report.json that is a folder)."""
        out = Path(self.out)
        found = sorted({path for pattern in RUN_OUTPUTS for path in out.glob(pattern)})
        for path in found:
            if path.is_symlink():
                raise UsageError(f"{path} is a symbolic link: certify writes only inside --out; remove the "
                                 "link or give another --out")
            if path.is_dir() != (path.name == "logs"):
                raise UsageError(f"{path} is a {'folder' if path.is_dir() else 'file'}, not what certify "
                                 "writes there: move it away or give another --out")
        return found

    def check_gpu_visible(self, target_resolved: bool = False) -> None:
        """UsageError where this machine surely shows certify no GPU (`gpu_absent`), before a worker
        starts: the command line asks, the run asks again, and the environment worker then asks
        torch. A --target run is refused only once its target is resolved (`target_resolved`; that
        imports the app), so that a bad name is said first."""
        target = isinstance(self.subject, Integration)
        if not isinstance(self.executor, Workers) or (target and not target_resolved):
            return
        absent = gpu_absent()
        if absent:
            raise UsageError(no_gpu_message(target, absent))


def check_out(out: Path) -> None:
    """UsageError when --out cannot become the run's folder: a file, a link to nothing, or a folder
    under a file (a run found it only when writing its first result, after its setup)."""
    if out.is_symlink() and not out.exists():
        raise UsageError(f"--out {out} is a symbolic link to nothing ({os.readlink(out)}): remove the link "
                         "or give another --out")
    for place in (out, *out.parents):
        if place.exists():
            if not place.is_dir():
                what = "is a file" if place == out else f"is under {place}, a file"
                raise UsageError(f"--out {out} {what}: give a folder to write the report into")
            return


def check_numbers(timeout, devices: str) -> None:
    """UsageError for a number out of range, before any worker starts or any file is written."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or not 0 < timeout <= MAX_TIMEOUT_S:
        raise UsageError(f"--timeout is {timeout!r}: give seconds above 0 and at most {MAX_TIMEOUT_S:g}")
    requested_devices(devices)


def requested_devices(text: str) -> list[int] | None:
    """The GPU indices --devices names (None: all), checked for form before anything runs."""
    if text == "all":
        return None
    try:
        indices = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--devices takes GPU indices such as 0,1 or 'all', not {text!r}") from None
    negative = [i for i in indices if i < 0]
    if negative:
        raise UsageError(f"--devices: {negative[0]} is not a GPU index (they count from 0)")
    if not indices:
        raise UsageError("--devices names no GPU")
    return list(dict.fromkeys(indices))


# The certify worker's test hook (`selftest.faults`): fake GPUs where the machine has none.
TEST_HOOK = "SAGE_QUAL_TEST_WORKER"


def test_hook() -> dict:
    """The test hook's settings ({} when unset), refused as a usage error naming the variable when
    it is not a JSON object: set to garbage, a worker died of a JSONDecodeError that named nothing."""
    text = os.environ.get(TEST_HOOK, "").strip()
    if not text:
        return {}
    fix = f"unset {TEST_HOOK} (it is the test suite's fake-GPU hook) or give it a JSON object"
    try:
        settings = json.loads(text)
    except ValueError as error:
        raise UsageError(f"{TEST_HOOK} is not JSON ({error}): {fix}") from None
    if not isinstance(settings, dict):
        raise UsageError(f"{TEST_HOOK} holds a {type(settings).__name__}, not a JSON object: {fix}")
    return settings


# Device nodes of a GPU torch can use on Linux: NVIDIA's, WSL's GPU bridge, AMD's ROCm.
GPU_NODES = ("/dev/nvidia[0-9]*", "/dev/dxg", "/dev/kfd")


def gpu_absent() -> str:
    """Why this machine surely shows certify no GPU, known without torch or a worker (a refusal in
    0.2 s instead of 7.5 s here); "" where it may have one, which the environment worker then asks
    torch about."""
    if test_hook():
        return ""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES is {visible!r}"
    if sys.platform == "linux" and not any(glob.glob(pattern) for pattern in GPU_NODES):
        return "no GPU device in /dev: none of " + ", ".join(GPU_NODES)
    return ""


def no_gpu_message(target: bool, why: str) -> str:
    purpose = ("certify --target needs the GPU it qualifies the integration on" if target
               else "certify needs the GPU it certifies; to predict the variants on this CPU with the "
                    "numerics model, run `sage-qual certify --emulate`")
    return f"no CUDA GPU is visible here ({why}): {purpose}"
