"""Gate and the wrapper agree on where a verdict holds (issue 53): for every kind of difference
between the machine a run was measured on and this one (`verdicts.machine.Kind`), gate says "stale"
exactly when `install(profile=that run's profile)` does not apply the run's entry, and where both
apply (a match or a near match) gate's verdict and what the wrapper serves are one.

The run is device run 43 (an H100 80GB HBM3, SageAttention 2.2.0 and comfy-kitchen 0.2.40, SM count
recorded); the host is that machine with one thing changed."""

import dataclasses

import pytest

from sage_qual.errors import ExitCode
from sage_qual.qualification.decide import checked, gate, verdict
from sage_qual.qualification.decide import profile as building
from sage_qual.qualification.families import counts_for, find
from sage_qual.serving import profile_matching as matching
from sage_qual.verdicts import machine
from sage_qual.verdicts.env_record import OtherProvider

from ..helpers import RESULTS

RUN43 = checked.load(RESULTS / "run43-h100" / "certify" / "report.json.gz")
PROFILE = building.build(RUN43, verdict.decide(RUN43))
FAMILIES = ["Krea-2", "SDXL"]  # enabled, and safe with no speedup


def host(change):
    """Run 43's machine with `change(fields)` applied: the environment gate collects, and the device
    the wrapper sees."""
    env, gpu = RUN43.environment, RUN43.environment.gpus[0]
    fields = {"name": gpu.name, "capability": tuple(gpu.capability), "memory_gib": gpu.memory_gib,
              "sm_count": gpu.sm_count, "torch": env.torch, "torch_cuda": env.torch_cuda,
              "driver": env.driver, "triton": env.triton, "sageattention": env.sageattention,
              "source": env.sageattention_source, "ck": env.other_providers[0].source}
    change(fields)
    gpus = [dataclasses.replace(gpu, name=fields["name"], capability=list(fields["capability"]),
                                memory_gib=fields["memory_gib"], sm_count=fields["sm_count"])]
    environment = dataclasses.replace(
        env, torch=fields["torch"], torch_cuda=fields["torch_cuda"], driver=fields["driver"],
        triton=fields["triton"], sageattention=fields["sageattention"], sageattention_source=fields["source"],
        other_providers=[OtherProvider("comfy-kitchen", "0.2.40", fields["ck"])], gpus=gpus)
    device = matching.LocalDevice(fields["name"], fields["capability"], fields["memory_gib"], fields["torch"],
                                 fields["torch_cuda"], fields["sageattention"], fields["source"],
                                 fields["sm_count"], {"comfy-kitchen": fields["ck"]})
    return environment, device


CHANGES = {
    machine.Kind.GPU: lambda f: f.update(name="NVIDIA H800"),
    machine.Kind.MEMORY: lambda f: f.update(memory_gib=93.1),
    machine.Kind.SM_COUNT: lambda f: f.update(sm_count=114),
    machine.Kind.CUDA: lambda f: f.update(torch_cuda="12.8"),
    machine.Kind.TORCH: lambda f: f.update(torch="2.12.0+cu130"),
    machine.Kind.TORCH_PATCH: lambda f: f.update(torch="2.11.1+cu130"),
    machine.Kind.DRIVER: lambda f: f.update(driver="590.10"),
    machine.Kind.TRITON: lambda f: f.update(triton="3.7.0"),
    machine.Kind.SAGEATTENTION: lambda f: f.update(sageattention="2.2.1"),
    machine.Kind.BUILD: lambda f: f.update(ck="sha256:0000000000000000"),
}


def test_every_kind_of_difference_is_tried():
    assert set(CHANGES) == set(machine.Kind) == set(machine.RULES)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", list(machine.Kind), ids=lambda kind: kind.value)
def test_gate_is_stale_exactly_where_the_wrapper_does_not_apply_the_entry(kind, family):
    environment, device = host(CHANGES[kind])
    local = {f.name: f.sha256 for f in RUN43.fixtures if counts_for(find(family), f.family)}
    decision = gate.decide_stored(RUN43, find(family), environment, local, require_speedup=False)
    [config] = matching.device_configs(PROFILE, [device], family=family)
    stale = decision.code == ExitCode.USAGE
    assert stale == (not config.matched), (decision.problem, config.note)
    assert stale == (machine.RULES[kind].effect == machine.Effect.NO_MATCH)
    if stale:
        assert decision.problem.startswith("stale report: ")
        return
    [(_, decided)] = decision.gpus
    served = decided.served
    table = config.config.kernel_table[device.capability]
    assert table == ((served.variant,) if served else ())
    if served:
        assert (config.config.min_query_tokens, config.config.max_query_tokens) == \
            (served.min_query_tokens, served.max_query_tokens)
    near = machine.RULES[kind].effect == machine.Effect.NEAR
    assert config.note.startswith("near match (") == near
    assert bool(decision.differences) == (kind in (machine.Kind.TORCH_PATCH, machine.Kind.DRIVER,
                                                   machine.Kind.TRITON))


def test_docs_certify_states_the_rules_as_declared():
    text = (RESULTS.parent / "certify.md").read_text()
    table = text.split("<!-- machine-rules -->")[1].split("<!-- /machine-rules -->")[0]
    rows = [line.strip("| ").split(" | ") for line in table.strip().splitlines()[2:]]
    assert rows == [[f"`{kind.value}`", rule.effect.value, rule.why] for kind, rule in machine.RULES.items()]
