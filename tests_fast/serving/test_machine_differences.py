"""`machine.differences()` at its edges (sage_qual/verdicts/machine.py): the SM-count tolerance at its
bound, a side with no torch, each label, a build one side does not record. Written at what a mutation
run of the module left alive against the profile and gate tests (docs/mutation.md, 2026-12-07)."""

import dataclasses

import pytest

from sage_qual.verdicts import machine
from sage_qual.verdicts.machine import Difference, Kind

H100 = machine.Machine("NVIDIA H100 80GB HBM3", (9, 0), 79.2, 100, "2.11.0+cu130", "13.0", "580.159.04",
                       "3.6.0", "2.2.0", machine.builds("sha256:aaaa", [("comfy-kitchen", "sha256:cccc")]))


def differ(**here) -> list[Difference]:
    return machine.differences(H100, dataclasses.replace(H100, **here))


@pytest.mark.parametrize("sm_count, differs", [(100, False), (90, False), (110, False), (89, True),
                                               (112, True)])
def test_within_a_tenth_of_the_sms_it_is_the_same_card(sm_count, differs):
    """The bound itself (90 of 100, 100 of 110) is inside: comfy-kitchen's table binds within 10 %."""
    assert [d.kind for d in differ(sm_count=sm_count)] == ([Kind.SM_COUNT] if differs else [])


def test_a_side_without_torch_is_said_as_none():
    assert differ(torch="") == [Difference(Kind.TORCH, "torch", "2.11.0+cu130", "none")]
    assert machine.differences(dataclasses.replace(H100, torch=""), H100) == [
        Difference(Kind.TORCH, "torch", "none", "2.11.0+cu130")]


def test_each_software_difference_is_named_as_users_know_it():
    found = differ(driver="590.1", triton="3.7.0", sageattention="2.2.1", cuda="13.1")
    assert [(d.kind, d.what) for d in found] == [
        (Kind.SAGEATTENTION, "sageattention"), (Kind.CUDA, "CUDA"), (Kind.DRIVER, "NVIDIA driver"),
        (Kind.TRITON, "Triton")]


def test_a_build_this_side_does_not_record_is_not_compared():
    assert differ(builds=machine.builds("sha256:aaaa", [])) == []
    assert differ(builds=machine.builds("", [("comfy-kitchen", "sha256:cccc")])) == []


def test_another_build_of_one_version_says_what_it_usually_is():
    [found] = differ(builds=machine.builds("sha256:bbbb", [("comfy-kitchen", "sha256:cccc")]))
    assert found == Difference(Kind.BUILD, "sageattention build", "sha256:aaaa", "sha256:bbbb",
                               "another source under one version: a fork or an older build")
    [other] = differ(builds=machine.builds("sha256:aaaa", [("comfy-kitchen", "sha256:dddd")]))
    assert other.what == "comfy-kitchen build"
