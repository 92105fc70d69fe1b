"""record_sdpa end to end on a small real PyTorch model on the CPU."""

import pytest
import torch
import torch.nn.functional as F

from sage_qual.fixtures.fileformat import load_fixture
from sage_qual.fixtures.recorder import record_sdpa


class Attention(torch.nn.Module):
    """Self-attention through F.scaled_dot_product_attention, with grouped-query heads if asked."""

    def __init__(self, dim=64, heads=4, kv_heads=4):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.to_q = torch.nn.Linear(dim, dim)
        self.to_kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.fail = False

    def forward(self, x):
        b, n, _ = x.shape
        q = self.to_q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.to_kv(x).view(b, n, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=self.kv_heads != self.heads)
        if self.fail:
            raise RuntimeError("forward failed")
        return x + out.transpose(1, 2).reshape(b, n, -1)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([Attention(), Attention(heads=4, kv_heads=2), Attention()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.fixture
def model():
    return Model().to(torch.bfloat16).eval()


@pytest.fixture
def x():
    return torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(1)).bfloat16()


@pytest.fixture
def passed(monkeypatch):
    """What the model hands to torch's SDPA, seen underneath the recorder."""
    calls = []
    original = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((q.clone(), k.clone(), v.clone()))
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


@torch.no_grad()
def test_select_by_index_keeps_the_call_as_passed(tmp_path, model, x, passed):
    with record_sdpa(tmp_path, family="test", model="tiny", select=2) as rec:
        model(x)
    assert rec.calls == 3 and len(rec.paths) == 1 and rec.skipped == []
    fixture = load_fixture(rec.paths[0])
    q, k, v = passed[2]
    assert fixture.kind == "recorded" and fixture.family == "test"
    assert torch.equal(fixture.q, q[:, [0]])  # default heads: the first K/V head's group
    assert torch.equal(fixture.k, k[:, [0]]) and torch.equal(fixture.v, v[:, [0]])
    assert fixture.source["call"] == 2 and fixture.source["model"] == "tiny"
    assert fixture.source["full_call"]["q"] == [2, 4, 40, 16]
    assert "call 2" in fixture.provenance


@torch.no_grad()
def test_select_by_shape_with_gqa_heads_and_rows(tmp_path, model, x, passed):
    def grouped(q, k, v):
        return k.shape[1] < q.shape[1]

    with record_sdpa(tmp_path, family="test", model="tiny", select=grouped, heads=[2, 3],
                     query_rows=slice(5, 37), key_rows=[0, 3, 7, 39]) as rec:
        model(x)
    assert len(rec.paths) == 1
    fixture = load_fixture(rec.paths[0])
    q, k, v = passed[1]
    # query heads 2 and 3 both use K/V head 1 (group of 2): one K/V head, grouping 2 kept
    assert torch.equal(fixture.q, q[:, [2, 3], 5:37])
    assert torch.equal(fixture.k, k[:, [1]][:, :, [0, 3, 7, 39]])
    assert torch.equal(fixture.v, v[:, [1]][:, :, [0, 3, 7, 39]])
    assert fixture.source["heads"] == [2, 3] and fixture.source["kv_heads"] == [1]
    assert fixture.source["query_rows"] == "5:37" and fixture.source["key_rows"] == [0, 3, 7, 39]


@torch.no_grad()
def test_select_by_module(tmp_path, model, x, passed):
    with record_sdpa(tmp_path, family="test", model="tiny", select=model.blocks[1], module_name="blocks.1",
                     heads=[1, 3]) as rec:
        model(x)
        model(x)
    assert [load_fixture(p).source["call"] for p in rec.paths] == [1, 4]
    fixture = load_fixture(rec.paths[1])
    q, k, v = passed[4]
    assert fixture.source["module"] == "blocks.1" and "blocks.1" in fixture.provenance
    # heads 1 and 3 use K/V heads 0 and 1: one query head per K/V head
    assert torch.equal(fixture.q, q[:, [1, 3]]) and torch.equal(fixture.k, k) and torch.equal(fixture.v, v)
    assert not model.blocks[1]._forward_hooks and not model.blocks[1]._forward_pre_hooks


def test_grouping_that_cannot_be_kept_is_refused(tmp_path, model, x):
    with (pytest.raises(ValueError, match="same number of query heads"),
          record_sdpa(tmp_path, family="test", select=1, heads=[0, 2, 3]), torch.no_grad()):
        model(x)


def test_calls_that_cannot_be_fixtures_are_skipped_with_reason(tmp_path):
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    with record_sdpa(tmp_path, family="test", select=lambda q, k, v: True) as rec:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        F.scaled_dot_product_attention(q.float(), q.float(), q.float())
        F.scaled_dot_product_attention(q, q, q, scale=0.5)
        F.scaled_dot_product_attention(q[0], q[0], q[0])
    assert [index for index, _ in rec.skipped] == [0, 1, 2, 3] and rec.paths == []
    assert "causal" in rec.skipped[0][1] and "dtype" in rec.skipped[1][1] and "scale" in rec.skipped[2][1]
    assert list(tmp_path.iterdir()) == []


def test_torch_function_restored_after_exit_and_after_an_exception(tmp_path, model, x):
    original = F.scaled_dot_product_attention
    with record_sdpa(tmp_path, family="test", select=0):
        assert F.scaled_dot_product_attention is not original
    assert F.scaled_dot_product_attention is original
    model.blocks[1].fail = True
    with (pytest.raises(RuntimeError, match="forward failed"),
          record_sdpa(tmp_path, family="test", select=model.blocks[1]), torch.no_grad()):
        model(x)
    assert F.scaled_dot_product_attention is original
    assert not model.blocks[1]._forward_hooks and not model.blocks[1]._forward_pre_hooks


@torch.no_grad()
def test_module_left_by_an_exception_stops_selecting(tmp_path, model, x):
    block = model.blocks[0]
    block.fail = True
    with record_sdpa(tmp_path, family="test", select=block) as rec:
        with pytest.raises(RuntimeError):
            model(x)
        F.scaled_dot_product_attention(*(torch.randn(1, 1, 8, 16, dtype=torch.bfloat16),) * 3)
    assert [load_fixture(p).source["call"] for p in rec.paths] == [0]  # call 1 was outside the module


@torch.no_grad()
def test_recording_does_not_change_the_model_output(tmp_path, model, x):
    expected = model(x)
    with record_sdpa(tmp_path, family="test", select=[0, 1, 2]) as rec:
        got = model(x)
    assert torch.equal(got, expected) and len(rec.paths) == 3


# Recording and the wrapper, bound over each other --------------------------------------------------

@pytest.fixture
def wrapper_box():
    """A fake GPU and fake sageattention under which install() succeeds."""
    from sage_qual.testing import FakeCuda, FakeGpu, FakeSageAttention

    with FakeCuda([FakeGpu((9, 0))]), FakeSageAttention().installed():
        yield


def test_uninstall_while_recording_gives_torch_its_function_back(tmp_path, model, x, wrapper_box):
    import sage_qual

    torch_own = F.scaled_dot_product_attention
    assert sage_qual.install().enabled
    with record_sdpa(tmp_path, family="test", select=lambda q, k, v: True) as recording:
        model(x)
        sage_qual.uninstall()
        model(x)  # still recorded: the recorder now calls torch directly
    assert F.scaled_dot_product_attention is torch_own
    assert recording.calls == 6 and len(recording.paths) == 6


def test_recording_that_ends_under_the_wrapper_is_taken_out_of_the_chain(tmp_path, model, x, wrapper_box):
    import sage_qual

    torch_own = F.scaled_dot_product_attention
    with record_sdpa(tmp_path, family="test", select=lambda q, k, v: True) as recording:
        assert sage_qual.install().enabled
        model(x)
    model(x)  # through the wrapper to torch; the ended recording sees nothing
    assert recording.calls == 3
    sage_qual.uninstall()
    assert F.scaled_dot_product_attention is torch_own
