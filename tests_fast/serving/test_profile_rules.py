"""serving/profile's rules in detail, on version 2 profiles (flat entries, upgraded as read): family
names as one family whatever the punctuation, a version 1 profile without its GPU, the schema's
identity, this machine as a profile must match it, what differs between an entry and a device (in
order), which entry is nearest, and each note's words."""

import dataclasses

import pytest
import torch

from sage_qual.serving import devices_here
from sage_qual.serving import profile_matching as matching
from sage_qual.serving.config import DEFAULT_CONFIG
from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention
from sage_qual.verdicts import machine as machine_rules
from sage_qual.verdicts import profile

TORCH = "2.11.0+cu130"
ENV = {"torch": TORCH, "torch_cuda": "13.0", "driver": "580", "sageattention": "2.2.0", "triton": "3.6.0"}


def entry(variant="sm90-fp8-cuda", min_q=2048, min_k=512, head_dims=(128,), reasons=(), **more):
    if variant is None:
        return {
            "variant": None,
            "min_query_tokens": None,
            "min_key_tokens": None,
            "head_dims": None,
            "reasons": [{"kind": k, "detail": d} for k, d in reasons],
            **more,
        }
    return {
        "variant": variant,
        "min_query_tokens": min_q,
        "min_key_tokens": min_k,
        "head_dims": list(head_dims),
        "reasons": [],
        **more,
    }


def gpu(name="NVIDIA H200", capability=(9, 0), memory=139.8, default=None, families=None, **env):
    return {
        "name": name,
        "capability": list(capability),
        "memory_gib": memory,
        "environment": {**ENV, **env},
        "default": default or entry(),
        "families": families or {},
    }


def load(*gpus) -> profile.Profile:
    return profile.load(
        {
            "kind": "sage-qual-profile",
            "schema_version": 2,
            "created": "2026-12-01",
            "host": "h",
            "fixtures": {},
            "gpus": list(gpus) or [gpu()],
        }
    )


def machine(
    name="NVIDIA H200",
    capability=(9, 0),
    memory=139.8,
    torch_version=TORCH,
    torch_cuda="13.0",
    sageattention="2.2.0",
):
    return matching.LocalDevice(name, capability, memory, torch_version, torch_cuda, sageattention)


# Family names ------------------------------------------------------------------------------------


@pytest.mark.parametrize("asked", ["Wan 2.2", "wan22", "WAN-2.2", "wan_2_2"])
def test_a_family_entry_is_found_whatever_its_punctuation(asked):
    wan = entry("sm80-fp16-cuda")
    chosen = load(gpu(families={"Wan 2.2": wan, "FLUX.1": entry()})).gpus[0]
    assert profile.family_entry(chosen, asked).variant == "sm80-fp16-cuda"
    assert profile.entry(chosen, asked).variant == "sm80-fp16-cuda"


def test_a_family_with_other_letters_is_another_family():
    chosen = load(gpu(families={"Wan 2.2": entry("sm80-fp16-cuda"), "SDXL": entry()})).gpus[0]
    assert profile.family_entry(chosen, "Wan 2.1") is None
    assert profile.family_entry(chosen, None) == chosen.default
    with pytest.raises(profile.ProfileError) as error:
        profile.entry(chosen, "FLUX.1")
    assert str(error.value) == (
        "the profile has no entry for family FLUX.1 on NVIDIA H200 (sm_90) (it has: "
        "Wan 2.2, SDXL): certify that family"
    )
    with pytest.raises(profile.ProfileError, match=r"\(it has: none\)"):
        profile.entry(load(gpu()).gpus[0], "FLUX.1")


# Reading ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gpu_value", [None, "NVIDIA H200", ["NVIDIA H200"]])
def test_a_version_1_profile_whose_gpu_is_not_an_object_is_a_profile_error(gpu_value):
    data = {
        "kind": "sage-qual-profile",
        "schema_version": 1,
        "created": "x",
        "host": "h",
        "fixtures": {},
        "environment": ENV,
        "default": entry(),
        "families": {},
    }
    if gpu_value is not None:
        data["gpu"] = gpu_value
    with pytest.raises(profile.ProfileError):
        profile.load(data)


def test_a_version_1_profile_reads_with_any_memory():
    data = {
        "kind": "sage-qual-profile",
        "schema_version": 1,
        "created": "x",
        "host": "h",
        "fixtures": {"f": "a"},
        "gpu": {"name": "NVIDIA H200", "capability": [9, 0]},
        "environment": ENV,
        "default": entry(),
        "families": {},
    }
    read = profile.load(data)
    assert read.schema_version == 3 and read.gpus[0].memory_gib is None and read.fixtures == {"f": "a"}
    assert texts(read.gpus[0], machine(memory=80.0)) == []


def test_the_schema_names_the_profile_and_its_version():
    schema = profile.json_schema()
    assert schema["$id"] == "https://sage-qual.invalid/profile/3"
    assert schema["title"] == "sage-qual profile, schema version 3"
    assert schema["description"] == (
        "profile.json, written by `sage-qual certify` and read by install(profile=...)"
    )


def test_this_machine_is_every_visible_device_with_the_installed_sageattention():
    gpus = [FakeGpu((9, 0), "NVIDIA H200", 139.8), FakeGpu((8, 9), "NVIDIA GeForce RTX 4090", 23.99)]
    with FakeCuda(gpus, torch_cuda=(12, 8)), FakeSageAttention(version="2.2.0+cu128").installed():
        found = devices_here.this_machine()
    assert found == [
        matching.LocalDevice("NVIDIA H200", (9, 0), 139.8, torch.__version__, "12.8", "2.2.0+cu128"),
        matching.LocalDevice(
            "NVIDIA GeForce RTX 4090", (8, 9), 24.0, torch.__version__, "12.8", "2.2.0+cu128"
        ),
    ]


def test_a_machine_without_cuda_in_torch_has_no_cuda_version():
    with FakeCuda([FakeGpu((9, 0), "NVIDIA H200", 139.8)], torch_cuda=None) as cuda:
        assert devices_here.machines(cuda, "2.2.0")[0].torch_cuda == ""


# What differs, and which entry is nearest -------------------------------------------------------------

def texts(gpu, device) -> list[str]:
    """What differs, in the one phrasing (`verdicts.machine`)."""
    return [d.text for d in matching.entry_differences(gpu, device)]


def near_match(gpu, device) -> bool:
    """The entry applies, as a near match (`verdicts.machine.RULES`)."""
    found = matching.entry_differences(gpu, device)
    return not machine_rules.binding(found) and bool(machine_rules.near(found))



def test_a_matching_device_differs_in_nothing():
    assert texts(load().gpus[0], machine()) == []
    assert texts(load().gpus[0], machine(name=" nvidia h200 ", memory=140.8)) == []


def test_differences_name_hardware_first_then_sageattention_cuda_and_torch():
    certified = load().gpus[0]
    here = machine(
        name="NVIDIA H100",
        capability=(9, 0),
        memory=79.6,
        torch_version="2.10.0+cu128",
        torch_cuda="12.8",
        sageattention="2.2.0.post1",
    )
    assert texts(certified, here) == [
        "GPU NVIDIA H200 (sm_90) measured, NVIDIA H100 (sm_90) here",
        "sageattention 2.2.0 measured, 2.2.0.post1 here",
        "CUDA 13.0 measured, 12.8 here",
        f"torch {TORCH} measured, 2.10.0+cu128 here",
    ]
    assert texts(certified, machine(capability=(9, 1))) == [
        "GPU NVIDIA H200 (sm_90) measured, NVIDIA H200 (sm_91) here"]
    assert texts(certified, machine(memory=141.0)) == ["memory 139.8 GiB measured, 141 here"]
    assert texts(certified, machine(memory=140.8)) == []  # within 1 GiB: the same card
    assert texts(load(gpu(memory=139.5)).gpus[0], machine(memory=140.5)) == []  # 1 GiB exactly
    assert texts(load(gpu(sageattention="")).gpus[0], machine()) == [
        "sageattention none measured, 2.2.0 here"
    ]
    assert texts(certified, machine(sageattention="")) == ["sageattention 2.2.0 measured, none here"]


@pytest.mark.parametrize(
    "here, near",
    [
        ("2.11.1+cu130", True),  # another patch release of the same build
        ("2.11.0+cu130", False),  # the same: a match, not a near match
        ("2.12.0+cu130", False),
        ("2.11.1+cu128", False),
        ("2.11.1", False),
        ("not-a-version", False),
    ],
)
def test_a_near_match_is_another_torch_patch_release_and_nothing_else(here, near):
    assert near_match(load().gpus[0], machine(torch_version=here)) is near


def test_a_near_match_needs_everything_else_equal():
    assert not near_match(load().gpus[0], machine(torch_version="2.11.1+cu130", memory=80.0))
    assert not near_match(
        load().gpus[0], machine(torch_version="2.11.1+cu130", sageattention="2.1.1")
    )


def test_the_nearest_entry_is_the_same_model_then_memory_then_software():
    h100 = gpu(name="NVIDIA H100", memory=79.6)
    h200_old = gpu(sageattention="2.1.1", torch_cuda="12.8")
    h200_cuda = gpu(torch_cuda="12.8")
    h200_nvl = gpu(name="NVIDIA H200 NVL", memory=141.0)
    read = load(h100, h200_old, h200_cuda, h200_nvl)
    assert matching.nearest(read, machine()).environment.torch_cuda == "12.8"  # same model, one difference
    assert matching.nearest(read, machine()).environment.sageattention == "2.2.0"
    assert matching.nearest(read, machine(name="NVIDIA H100", memory=79.6)).name == "NVIDIA H100"
    assert matching.nearest(read, machine(name="NVIDIA H200 NVL", memory=141.0)).name == "NVIDIA H200 NVL"
    # An unknown sm_90 GPU: the entry with its memory first.
    assert matching.nearest(read, machine(name="NVIDIA GH200", memory=79.0)).name == "NVIDIA H100"
    # The same model beats one of another name on the same capability, however well its software matches.
    other_name = gpu(name="NVIDIA H100")
    same_name = gpu(torch_cuda="12.8")
    assert matching.nearest(load(same_name, other_name), machine()).name == "NVIDIA H200"
    assert matching.nearest(load(other_name, same_name), machine()).name == "NVIDIA H200"
    # Among equals, the first in the file.
    assert matching.nearest(load(gpu(memory=139.8), gpu(memory=139.9)), machine()).memory_gib == 139.8


def test_the_nearest_prefers_the_same_torch_release_then_the_same_torch():
    read = load(gpu(torch="2.10.0+cu130"), gpu(torch="2.11.5+cu130"), gpu(torch="2.11.0+cu130"))
    assert matching.nearest(read, machine(torch_version="2.11.0+cu130")).environment.torch == "2.11.0+cu130"
    assert matching.nearest(read, machine(torch_version="2.11.3+cu130")).environment.torch == "2.11.5+cu130"
    read = load(gpu(capability=(8, 9), name="X", default=entry("sm89-fp8-cuda")),
                gpu(capability=(9, 0), name="Y"))
    assert matching.nearest(read, machine(name="Z", capability=(9, 0))).name == "Y"


# Notes -----------------------------------------------------------------------------------------------


def notes(read, here, family=None, base=DEFAULT_CONFIG):
    return matching.device_configs(read, [here], family, base)[0]


def test_the_note_of_a_served_entry_names_variant_start_and_range():
    chosen = entry(max_query_tokens=32768, layouts=["contiguous", "transposed"])
    found = notes(load(gpu(default=chosen)), machine())
    assert found.note == (
        "profile entry NVIDIA H200 (sm_90): sm90-fp8-cuda 2,048 to 32,768 query / 512 to 32,768 key tokens, "
        "head_dim 128 (contiguous, transposed)"
    )
    assert found.matched and found.reasons == ()


def test_a_near_match_note_says_what_differs():
    found = notes(load(), machine(torch_version="2.11.1+cu130"), family=None)
    said = f"near match (torch {TORCH} measured, 2.11.1+cu130 here): profile entry NVIDIA H200"
    assert found.note.startswith(said)
    assert found.config.kernel_table[(9, 0)] == ("sm90-fp8-cuda",) and found.matched


def test_an_entry_that_serves_nothing_gives_its_first_reason_or_a_count():
    one = entry(None, reasons=[("accuracy", "fails qwen_image_b52 relative L2")])
    found = notes(load(gpu(default=one)), machine())
    assert found.note == (
        "the profile certifies no SageAttention variant on NVIDIA H200 (sm_90): fails "
        "qwen_image_b52 relative L2"
    )
    assert found.reasons == ("fails qwen_image_b52 relative L2",)
    two = entry(None, reasons=[("accuracy", "first"), ("speed", "second")])
    found = notes(load(gpu(families={"SDXL": two})), machine(), family="SDXL")
    assert found.note == (
        "the profile certifies no SageAttention variant on NVIDIA H200 (sm_90), family SDXL: "
        "2 reasons in profile_reasons, first: first"
    )
    assert found.reasons == ("first", "second")
    none = entry(None)
    assert notes(load(gpu(default=none)), machine()).note.endswith("(sm_90): no reason recorded")
    # Asked for one family that is off, the note is about that family, not the ones served.
    found = notes(load(gpu(families={"SDXL": one, "FLUX.1": entry()})), machine(), family="SDXL")
    assert found.note == (
        "the profile certifies no SageAttention variant on NVIDIA H200 (sm_90), family SDXL: "
        "fails qwen_image_b52 relative L2"
    )


def test_a_profile_that_enables_some_families_says_which_and_how_to_pick_one():
    off = entry(None, reasons=[("accuracy", "a"), ("accuracy", "b")])
    served = {name: entry() for name in ("FLUX.1", "FLUX.2", "Z-Image", "Krea-2", "Wan 2.2")}
    found = notes(load(gpu(default=off, families={**served, "SDXL": entry(None)})), machine())
    assert found.note == (
        "the profile enables only FLUX.1, FLUX.2, Z-Image, Krea-2 and 1 more here, pick one: "
        'install(profile=..., family="Wan 2.2"); why not all: 2 reasons in profile_reasons'
    )
    few = notes(load(gpu(default=off, families={"SDXL": entry()})), machine())
    assert few.note.startswith(
        'the profile enables only SDXL here, pick one: install(profile=..., family="SDXL")'
    )


def test_a_device_no_entry_matches_keeps_the_defaults_and_names_the_nearest():
    base = dataclasses.replace(DEFAULT_CONFIG, min_query_tokens=1536, min_key_tokens=512)
    found = notes(load(), machine(name="NVIDIA L40S", capability=(8, 9), memory=44.4), base=base)
    assert found.config is base and not found.matched
    assert found.note == (
        "no profile entry matches: defaults here (1536/512 tokens); nearest NVIDIA H200 "
        "(sm_90) differs: GPU NVIDIA H200 (sm_90) measured, NVIDIA L40S (sm_89) here"
    )


def test_a_family_the_nearest_entry_keeps_off_stays_off_on_another_device():
    off = entry(None, reasons=[("accuracy", "NaN on a zero V channel")])
    read = load(gpu(default=entry(), families={"SDXL": off}))
    found = notes(read, machine(torch_version="2.10.0+cu128", torch_cuda="12.8"), family="SDXL")
    assert found.config.kernel_table[(9, 0)] == () and not found.matched
    assert found.note.startswith(
        "no profile entry matches, and the nearest keeps family SDXL off, so off here; "
        "nearest NVIDIA H200 (sm_90) differs: CUDA 13.0 measured, 12.8 here"
    )
    assert found.reasons == ("NaN on a zero V channel",)
    everything = notes(load(gpu(default=off)), machine(torch_cuda="12.8"))
    assert "keeps all families off" in everything.note
    served = notes(read, machine(torch_cuda="12.8"), family="FLUX.1")  # no entry for it: the defaults
    assert served.note.startswith("no profile entry matches: defaults here")


def test_each_device_gets_its_own_base_config():
    bases = [
        dataclasses.replace(DEFAULT_CONFIG, min_query_tokens=100),
        dataclasses.replace(DEFAULT_CONFIG, min_query_tokens=200),
    ]
    here = [machine(), machine(name="Other", capability=(8, 9))]
    found = matching.device_configs(load(), here, None, bases)
    assert found[0].config.min_query_tokens == 2048  # the entry's threshold over its own base
    assert found[1].config is bases[1]
    with pytest.raises(ValueError):
        matching.device_configs(load(), [machine()], None, bases)


def test_an_entry_applies_to_its_capability_only_with_its_span_limit():
    read = load(gpu(default=entry(max_query_tokens=20000, layouts=["contiguous"])))
    read_gpu = dataclasses.replace(read.gpus[0], max_span_elements=1_000_000)
    config = matching.apply(DEFAULT_CONFIG, (9, 0), read_gpu.default, read_gpu.max_span_elements)
    assert config.kernel_table[(9, 0)] == ("sm90-fp8-cuda",)
    assert config.kernel_table[(8, 9)] == DEFAULT_CONFIG.kernel_table[(8, 9)]
    assert (config.min_query_tokens, config.min_key_tokens, config.head_dims) == (2048, 512, (128,))
    assert (config.max_query_tokens, config.max_key_tokens, config.layouts) == (20000, None, ("contiguous",))
    assert config.max_span_elements == 1_000_000
    assert (
        matching.apply(DEFAULT_CONFIG, (9, 0), read_gpu.default).max_span_elements
        == DEFAULT_CONFIG.max_span_elements
    )
    off = matching.apply(DEFAULT_CONFIG, (9, 0), profile.Entry(None))
    assert off.kernel_table[(9, 0)] == () and off.min_query_tokens == DEFAULT_CONFIG.min_query_tokens


def test_a_matched_family_entry_says_its_family_and_a_served_entry_gives_no_reasons():
    served = {**entry(), "reasons": [{"kind": "speed", "detail": "slower below 2048 tokens"}]}
    found = notes(load(gpu(families={"FLUX.1": served})), machine(), family="FLUX.1")
    assert found.note.startswith(
        "profile entry NVIDIA H200 (sm_90), family FLUX.1: sm90-fp8-cuda >= 2048/512"
    )
    assert found.reasons == () and found.matched is True


def test_the_nearest_entry_lists_every_difference():
    found = notes(load(), machine(torch_version="2.10.0+cu128", torch_cuda="12.8"))
    assert found.note.endswith(
        f"nearest NVIDIA H200 (sm_90) differs: CUDA 13.0 measured, 12.8 here; torch {TORCH} measured, "
        "2.10.0+cu128 here"
    )
    kept_off = notes(load(gpu(default=entry(None))), machine(torch_cuda="12.8"))
    assert kept_off.matched is False


# What a profile entry may hold ----------------------------------------------------------------------


def refusal(default=None, gpus=None) -> str:
    with pytest.raises(profile.ProfileError) as error:
        load(*(gpus if gpus is not None else [gpu(default=default)])) if gpus != [] else profile.load(
            {
                "kind": "sage-qual-profile",
                "schema_version": 2,
                "created": "x",
                "host": "h",
                "fixtures": {},
                "gpus": [],
            }
        )
    message = str(error.value)
    assert message.startswith("profile: ") and message.endswith("; " + profile.FIX)
    return message.removeprefix("profile: ").removesuffix("; " + profile.FIX)


@pytest.mark.parametrize(
    "default, says",
    [
        (
            {**entry(None), "min_query_tokens": 5},
            "gpus[0].default.variant: null, but min_query_tokens is given: "
            "a profile serves nothing without a variant",
        ),
        (
            {**entry(None), "layouts": ["contiguous"]},
            "gpus[0].default.variant: null, but layouts is given: "
            "a profile serves nothing without a variant",
        ),
        (
            entry("sm99"),
            "gpus[0].default.variant: 'sm99' is not a SageAttention variant sage-qual knows "
            "(sm80-fp16-cuda, sm80-fp16-cuda-fp16acc, sm86-fp16-triton, sm89-fp8-cuda, "
            "sm89-fp8-cuda-fp32acc, sm90-fp8-cuda, sm120-fp8-perwarp, sm120-fp8-perwarp-fp32acc, "
            "ck-int8-cuda)",
        ),
        (entry(min_q=0), "gpus[0].default.min_query_tokens: is 0, expected a token count of at least 1"),
        (entry(min_k=None), "gpus[0].default.min_key_tokens: is null, expected an integer"),
        (entry(head_dims=[]), "gpus[0].default.head_dims: empty: name the head sizes served"),
        (
            entry(head_dims=[64, 96]),
            "gpus[0].default.head_dims: 96 is not a head size the kernels take (64, 128)",
        ),
        (
            entry(max_query_tokens=2047),
            "gpus[0].default.max_query_tokens: is 2047, below min_query_tokens 2048: "
            "the verified range is empty",
        ),
        (
            entry(max_key_tokens=511),
            "gpus[0].default.max_key_tokens: is 511, below min_key_tokens 512: the verified range is empty",
        ),
        (entry(layouts=[]), "gpus[0].default.layouts: empty: name the verified layouts, or null for any"),
        (
            entry(layouts=["contiguous", "diagonal"]),
            "gpus[0].default.layouts: 'diagonal' is not a layout sage-qual "
            "knows (contiguous, transposed, fused_qkv, nhd)",
        ),
    ],
)
def test_an_entry_that_cannot_serve_as_written_is_refused_naming_the_key(default, says):
    assert refusal(default) == says


def test_an_entry_at_its_edges_reads():
    at_edges = entry(
        min_q=1,
        min_k=1,
        head_dims=[64, 128],
        max_query_tokens=1,
        max_key_tokens=1,
        layouts=["contiguous", "nhd"],
    )
    assert load(gpu(default=at_edges)).gpus[0].default.served.max_key_tokens == 1
    assert load(gpu(default=entry(None))).gpus[0].default.variant is None


def test_a_profile_certifies_at_least_one_gpu():
    assert refusal(gpus=[]) == "gpus: empty: a profile certifies at least one GPU model"


def test_memory_then_cuda_decide_between_entries_of_one_model():
    # Memory within 1 GiB (exactly 1 included) comes before the software.
    read = load(gpu(memory=139.5, torch_cuda="12.8"), gpu(memory=150.0))
    assert matching.nearest(read, machine(memory=140.5)).memory_gib == 139.5
    # Then CUDA: the entry with this machine's CUDA, wherever it stands in the file.
    read = load(gpu(torch_cuda="12.8"), gpu(torch_cuda="13.0", torch="2.10.0+cu130"))
    assert matching.nearest(read, machine()).environment.torch_cuda == "13.0"
    # An unknown GPU of a known capability: the entry whose memory matches, not the first.
    read = load(gpu(), gpu(name="NVIDIA H100", memory=79.6))
    assert matching.nearest(read, machine(name="NVIDIA GH200", memory=79.0)).name == "NVIDIA H100"


def test_a_profile_file_that_cannot_be_used_is_named_in_the_error(tmp_path):
    foreign = tmp_path / "other.json"
    foreign.write_text('{"kind": "something"}')
    with pytest.raises(profile.ProfileError) as error:
        profile.load(foreign)
    assert str(error.value) == f"{foreign} is not a sage-qual profile (written by `sage-qual certify`)"
    newer = tmp_path / "newer.json"
    newer.write_text('{"kind": "sage-qual-profile", "schema_version": 9}')
    with pytest.raises(profile.ProfileError, match=f"^{newer} has profile schema version 9; "):
        profile.load(newer)
    cut = tmp_path / "cut.json"
    cut.write_text('{"kind": "sage-qual-pro')
    with pytest.raises(profile.ProfileError) as error:
        profile.load(cut)
    assert str(error.value).startswith(f"profile {cut} is not JSON, or cut short: ")
    assert str(error.value).endswith("; " + profile.FIX)
    with pytest.raises(profile.ProfileError) as error:
        profile.load(tmp_path)  # a directory
    assert str(error.value).startswith(f"cannot read profile {tmp_path}: ")
