"""The in-place decode kernel: the attention of gathering the blocks and running SDPA, to
rounding, for MHA, GQA and MQA rows of different lengths; bad indices refused; the engine
falling back to the gather when the kernel cannot be built; and the same kernel over the static
cache of the compiled one-token step (decoderlm::static_decode_attention), and over the pools by
the op of the engine's compiled decode pass (decoderlm::paged_decode_attention)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from decoderlm import DecoderLM, ModelConfig
from decoderlm.cpu import paged_attention
from decoderlm.cpu.paged_attention import (
    available,
    paged_decode_attention,
    paged_decode_op,
    static_available,
    static_decode_attention,
)
from decoderlm.engine.engine import Engine
from decoderlm.inference.generate import generate
from decoderlm.tokenizer import Tokenizer

HAS_COMPILER = shutil.which(os.environ.get("CC", "cc")) is not None
needs_kernel = pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler ($CC or cc) to build it")
needs_op = pytest.mark.skipif(
    not static_available(torch.float32), reason="no C and C++ compilers to build the op"
)


def pools_and_rows(h_kv: int, dtype: torch.dtype, lengths: list[int], block_size: int = 4):
    """Random pools of 40 blocks and, per row, distinct blocks in shuffled order (B, W)."""
    g = torch.Generator().manual_seed(h_kv)
    k, v = (torch.randn(40, block_size, h_kv, 16, generator=g).to(dtype) for _ in range(2))
    width = -(-max(lengths) // block_size)
    table = torch.randperm(40, generator=g)[: len(lengths) * width].view(len(lengths), width)
    return k, v, table, torch.tensor(lengths)


def gathered(pool: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """Each row's first n positions, (B, Hkv, n, hd): what the gather path hands SDPA."""
    blocks = pool[table.flatten()].view(table.shape[0], -1, *pool.shape[2:])
    return blocks[:, :n].transpose(1, 2)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h_kv", [8, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_in_place_attention_is_as_close_to_float64_as_gather_and_sdpa(dtype, h_kv):
    # Rows of 1 key, exactly one block, a block and one, several blocks and a part.
    lengths = [1, 4, 5, 11, 16, 19]
    k, v, table, n = pools_and_rows(h_kv, dtype, lengths)
    q = torch.randn(len(lengths), 8, 1, 16, generator=torch.Generator().manual_seed(7)).to(dtype)
    mask = (torch.arange(max(lengths))[None, :] < n[:, None])[:, None, None]  # (B, 1, 1, Tk)
    group = (len(lengths), h_kv, 8 // h_kv, 16)  # the GQA fold: (B, Hkv, G, hd)

    def sdpa(q, k, v):
        keys, values = gathered(k, table, max(lengths)), gathered(v, table, max(lengths))
        return F.scaled_dot_product_attention(q.reshape(group), keys, values, attn_mask=mask)

    assert_as_close_to_float64_as(
        sdpa, paged_decode_attention(q, k, v, table, n, 16**-0.5), q, k, v
    )


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (16, 1, 80)], ids=str)
def test_a_rows_attention_is_the_same_bits_alone_or_among_64_rows(dtype, heads):
    # 64 rows: each item takes a K/V head and all its query heads; one row: one query head each.
    # Head sizes 64 and 128 run the kernel's unrolled forms, 80 the general one (and a tail).
    h, h_kv, d = heads
    g = torch.Generator().manual_seed(d)
    k, v = (torch.randn(512, 16, h_kv, d, generator=g).to(dtype) for _ in range(2))
    lengths = torch.randint(1, 120, (64,), generator=g)
    table = torch.randperm(512, generator=g)[: 64 * 8].view(64, 8)
    q = torch.randn(64, h, 1, d, generator=g).to(dtype)
    together = paged_decode_attention(q, k, v, table, lengths, d**-0.5)
    for b in (0, 17, 63):
        alone = paged_decode_attention(q[b : b + 1], k, v, table[b : b + 1], lengths[b : b + 1], d**-0.5)  # fmt: skip
        assert torch.equal(alone[0], together[b])
    keys = gathered(k, table, 128).double()  # (B, Hkv, 128, hd)
    values = gathered(v, table, 128).double()
    mask = (torch.arange(128)[None, :] < lengths[:, None])[:, None, None]  # (B, 1, 1, Tk)
    exact = F.scaled_dot_product_attention(
        q.double().view(64, h_kv, h // h_kv, d), keys, values, attn_mask=mask, scale=d**-0.5
    ).view(64, h, 1, d)
    # The output's rounding (half an ulp ≤ eps·|x| / 2) with room to spare, and float32's sums.
    bound = torch.finfo(dtype).eps * exact.abs().clamp(min=1) + 1e-5
    assert ((together.double() - exact).abs() <= bound).all()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [64, 1], ids=["item-per-head", "item-per-query-head"])
def test_appending_the_new_keys_in_the_kernel_equals_storing_them_first(dtype, rows):
    # 64 rows: each item writes its own row's new key and value; one row: several items read
    # them (one per query head), so the kernel writes them all first.
    g = torch.Generator().manual_seed(rows)
    k, v = (torch.randn(512, 16, 3, 64, generator=g).to(dtype) for _ in range(2))
    lengths = torch.randint(1, 120, (rows,), generator=g)
    table = torch.randperm(512, generator=g)[: rows * 8].view(rows, 8)
    q = torch.randn(rows, 9, 1, 64, generator=g).to(dtype)
    qkv = torch.randn(rows, 1, 2, 3, 64, generator=g).to(dtype)  # k, v as strided views
    k_new, v_new = (qkv[:, :, i].transpose(1, 2) for i in range(2))  # (B, 3, 1, 64) each
    last = lengths - 1  # each row's new position
    slots = table.gather(1, (last // 16)[:, None])[:, 0] * 16 + last % 16
    stored_k, stored_v = k.clone(), v.clone()
    stored_k.view(-1, 3, 64)[slots] = k_new[:, :, 0]
    stored_v.view(-1, 3, 64)[slots] = v_new[:, :, 0]
    expected = paged_decode_attention(q, stored_k, stored_v, table, lengths, 0.125)
    got = paged_decode_attention(q, k, v, table, lengths, 0.125, new=(k_new, v_new))
    assert torch.equal(got, expected)
    assert torch.equal(k, stored_k) and torch.equal(v, stored_v)  # nothing else written


CHUNK = 256  # paged_attention.c's keys per item: longer rows are split and merged


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h_kv", [2, 1], ids=["GQA", "MQA"])
def test_rows_split_into_chunks_are_as_close_to_float64_as_gather_and_sdpa(dtype, h_kv):
    # A chunk less one key, one chunk, one and a key, several and a part; one row alone (items per
    # query head) and six (items per K/V head): each chunk's o, m, l merged.
    lengths = [CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 77, 5, 2 * CHUNK]
    g = torch.Generator().manual_seed(h_kv)
    k, v = (torch.randn(400, 16, h_kv, 16, generator=g).to(dtype) for _ in range(2))
    table, n = torch.randperm(400, generator=g)[: 6 * 53].view(6, 53), torch.tensor(lengths)
    q = torch.randn(len(lengths), 8, 1, 16, generator=g).to(dtype)
    mask = (torch.arange(max(lengths))[None, :] < n[:, None])[:, None, None]  # (B, 1, 1, Tk)
    for rows in (slice(3, 4), slice(0, 6)):
        group = (rows.stop - rows.start, h_kv, 8 // h_kv, 16)

        def sdpa(q, k, v, rows=rows, group=group):
            keys, values = gathered(k, table[rows], max(lengths)), gathered(v, table[rows], max(lengths))  # fmt: skip
            return F.scaled_dot_product_attention(q.reshape(group), keys, values, attn_mask=mask[rows])  # fmt: skip

        got = paged_decode_attention(q[rows], k, v, table[rows], n[rows], 16**-0.5)
        assert_as_close_to_float64_as(sdpa, got, q[rows], k, v)


@needs_kernel
def test_a_split_rows_attention_is_the_same_bits_alone_or_among_other_rows():
    # The chunks follow the row's own length, never the batch: alone, its few items go to one
    # query head each; among 16 rows, to a K/V head each.
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(640, 16, 3, 64, generator=g) for _ in range(2))
    lengths = torch.randint(1, 640, (16,), generator=g)
    lengths[5] = 2 * CHUNK + 1
    table = torch.randperm(640, generator=g)[: 16 * 40].view(16, 40)
    q = torch.randn(16, 9, 1, 64, generator=g)
    together = paged_decode_attention(q, k, v, table, lengths, 0.125)
    for b in (0, 5, 15):
        alone = paged_decode_attention(q[b : b + 1], k, v, table[b : b + 1], lengths[b : b + 1], 0.125)  # fmt: skip
        assert torch.equal(alone[0], together[b])


def assert_as_close_to_float64_as(sdpa, got, q, k, v) -> None:
    """got: the kernel's output; the same sums in another order as sdpa(q, k, v) (B, Hkv, G, hd),
    so within 2× that one's own error against float64 (+ 1 ulp of 1)."""
    exact = sdpa(q.double(), k.double(), v.double()).reshape(q.shape)
    reference_error = (sdpa(q, k, v).reshape(q.shape).double() - exact).abs().max()
    assert got.shape == q.shape and got.dtype == q.dtype
    assert (got.double() - exact).abs().max() <= 2 * reference_error + torch.finfo(q.dtype).eps


@needs_kernel
def test_loading_the_kernel_leaves_subnormal_floats_alone():
    # A -ffast-math shared library can switch the process to flush subnormals to zero on load
    # (hypothesis refuses to run then); the kernel is linked without crtfastmath.
    assert available(torch.float32, torch.device("cpu"))
    assert sys.float_info.min / 2 > 0.0
    assert torch.tensor(1e-40) * 1.0 > 0


@needs_kernel
def test_indices_outside_the_pool_or_the_table_are_refused_before_the_kernel_reads_them():
    k, v, table, n = pools_and_rows(2, torch.float32, [3, 9])
    q = torch.randn(2, 4, 1, 16)
    with pytest.raises(ValueError, match="outside the pool"):
        paged_decode_attention(q, k, v, table + 40, n, 1.0)
    with pytest.raises(ValueError, match="beyond the 3 blocks"):
        paged_decode_attention(q, k, v, table, torch.tensor([3, 13]), 1.0)
    with pytest.raises(ValueError, match="q"):
        paged_decode_attention(q.expand(2, 4, 2, 16), k, v, table, n, 1.0)


def engine_layers_in_place(monkeypatch, tmp_path, compiler: str | None) -> list[bool]:
    """Which layers of a new float32 engine attend in place, with $CC set to `compiler`."""
    if compiler is not None:
        monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("DECODERLM_CACHE", str(tmp_path))
    paged_attention._library.cache_clear()
    try:
        tok = Tokenizer.train_char(["abcdefgh"])
        config = ModelConfig.from_preset(
            "llama-tiny", vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4
        )
        engine = Engine(DecoderLM(config).eval(), tok, kv_cache_memory="1MiB")
        return [layer.in_place for layer in engine.runner.cache.layers]
    finally:
        paged_attention._library.cache_clear()


@needs_kernel
def test_the_engine_builds_the_kernel_and_attends_in_place(monkeypatch, tmp_path):
    assert engine_layers_in_place(monkeypatch, tmp_path, None) == [True, True]
    assert len(list((tmp_path / "kernels").glob("paged_attention-*.so"))) == 1


@needs_kernel
def test_a_damaged_kernel_in_the_cache_is_rebuilt(monkeypatch, tmp_path):
    monkeypatch.setenv("DECODERLM_CACHE", str(tmp_path))
    damaged = paged_attention.library_path()
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"not an ELF file")
    # In a process of its own: this one may have loaded a library of that name already.
    check = "import torch; from decoderlm.cpu.paged_attention import available as a; "
    check += "print(a(torch.float32, torch.device('cpu')))"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert done.stdout.strip() == "True", done.stderr
    assert damaged.read_bytes()[:4] == b"\x7fELF"


@needs_kernel
def test_a_cache_that_cannot_be_written_leaves_the_engine_on_the_gather(monkeypatch, tmp_path):
    (tmp_path / "file").write_text("")  # a file where the cache's directory would go
    assert engine_layers_in_place(monkeypatch, tmp_path / "file", None) == [False, False]


@pytest.mark.parametrize("compiler", ["false", "/no/such/cc"], ids=["fails", "missing"])
def test_without_a_working_compiler_the_engine_gathers_the_blocks(monkeypatch, tmp_path, compiler):
    assert engine_layers_in_place(monkeypatch, tmp_path, compiler) == [False, False]
    assert not available(torch.float32, torch.device("cpu"))
    paged_attention._library.cache_clear()


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h_kv", [8, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_in_place_attention_over_the_static_cache_is_as_close_to_float64_as_masked_sdpa(
    dtype, h_kv
):
    g = torch.Generator().manual_seed(h_kv)
    pad, slot, slots = torch.tensor([0, 3, 12, 13]), torch.tensor([13]), 21  # row 3: one key
    k, v = (torch.randn(4, h_kv, slots, 16, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(4, 8, 1, 16, generator=g).to(dtype)
    positions = torch.arange(slots)
    mask = ((positions >= pad[:, None]) & (positions <= slot))[:, None, None]  # (B, 1, 1, S)
    group = (4, h_kv, 8 // h_kv, 16)  # the GQA fold: (B, Hkv, G, hd)

    def sdpa(q, k, v):  # what the compiled step ran before: the whole buffer and a mask
        return F.scaled_dot_product_attention(q.reshape(group), k, v, attn_mask=mask)

    assert_as_close_to_float64_as(
        sdpa, static_decode_attention(q, k, v, pad, slot, 16**-0.5), q, k, v
    )


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h_kv", [8, 2], ids=["MHA", "GQA"])
def test_a_prompts_queries_in_place_are_close_to_float64_and_each_the_bits_of_itself_alone(
    dtype, h_kv
):
    """static_attention: the T queries of left-padded rows (300 slots: keys in two chunks), each
    over its row's keys up to itself, as masked causal SDPA to rounding; every real query's
    output is, bit for bit, that of the same query computed alone by the decode op."""
    g = torch.Generator().manual_seed(h_kv)
    pad, slots = torch.tensor([0, 7, 299]), 300  # row 2: one real token, in the last slot
    k, v = (torch.randn(3, h_kv, slots, 16, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(3, 8, slots, 16, generator=g).to(dtype)
    positions = torch.arange(slots)
    causal = positions[:, None] >= positions[None, :]  # (T, S)
    mask = (causal & (positions >= pad[:, None, None]))[:, None, None]  # (B, 1, 1, T, S)
    real = positions[None, :] >= pad[:, None]  # (B, T): queries outside the padding
    group = (3, h_kv, 8 // h_kv, slots, 16)

    def sdpa(q, k, v):
        fold = F.scaled_dot_product_attention(
            q.reshape(group), k[:, :, None], v[:, :, None], attn_mask=mask
        )
        return fold.reshape(q.shape).nan_to_num() * real[:, None, :, None]

    got = paged_attention.static_attention(q, k, v, pad, positions, 0.25)
    assert_as_close_to_float64_as(sdpa, got * real[:, None, :, None], q, k, v)
    if static_available(dtype):
        for t in (0, 8, 256, 299):  # (256: past one chunk of keys)
            alone = static_decode_attention(q[:, :, t : t + 1], k, v, pad.clamp(max=t),
                                            torch.tensor([t]), 0.25)  # fmt: skip
            assert torch.equal(alone, got[:, :, t : t + 1])


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_paged_op_equals_the_kernel_and_refuses_blocks_outside_the_pool(dtype):
    """decoderlm::paged_decode_attention (the compiled engine pass's) is the same C kernel:
    equal outputs, and the indices checked in C++ before it reads them."""
    lengths = [1, 4, 5, 11, 16, 19]
    k, v, table, n = pools_and_rows(2, dtype, lengths)
    q = torch.randn(len(lengths), 8, 1, 16, generator=torch.Generator().manual_seed(7)).to(dtype)
    expected = paged_decode_attention(q, k, v, table, n, 0.25)
    assert torch.equal(paged_decode_op(q, k, v, table, n, 0.25), expected)
    outside = table.clone()
    outside[3, 1] = 40
    with pytest.raises(RuntimeError, match="row 3's block 40 is outside the pool's 40"):
        paged_decode_op(q, k, v, outside, n, 0.25)
    with pytest.raises(RuntimeError, match="row 0's length 0"):
        paged_decode_op(q, k, v, table, torch.tensor([0, *lengths[1:]]), 0.25)


@needs_op
def test_static_cache_slots_outside_the_cache_or_before_a_rows_start_are_refused():
    k = v = torch.zeros(2, 1, 8, 16)
    q = torch.zeros(2, 4, 1, 16)
    for pad, slot, message in [
        ([0, 0], [8], "last slot outside"),
        ([0, 5], [4], "row 1's first slot 5"),
        ([-1, 0], [4], "row 0's first slot -1"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            static_decode_attention(q, k, v, torch.tensor(pad), torch.tensor(slot), 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        static_decode_attention(
            q, k.transpose(1, 2), v, torch.tensor([0, 0]), torch.tensor([1]), 1.0
        )


@needs_op
def test_the_compiled_step_attends_in_place_and_decodes_the_eager_tokens_of_padded_rows():
    torch.manual_seed(0)
    config = ModelConfig.from_preset("llama-tiny", vocab_size=97, d_model=64, n_layers=2)
    model = DecoderLM(config).eval()
    prompts = [[5, 17, 3, 42, 8, 1, 9], [11, 2]]  # the second row is left-padded by 5
    eager = generate(model, prompts, 12, temperature=0)
    compiled = generate(model, prompts, 12, temperature=0, compile=True)  # builds the step first
    with torch.profiler.profile() as prof:
        generate(model, prompts, 12, temperature=0, compile=True)
    names = {event.key for event in prof.key_averages()}
    assert "decoderlm::static_decode_attention" in names
    assert compiled == eager


WITHOUT_COMPILERS = """
import torch
from decoderlm import DecoderLM, ModelConfig
from decoderlm.cpu.decode import attends_in_place

model = DecoderLM(ModelConfig.from_preset("llama-tiny", vocab_size=97)).eval()
print(attends_in_place(model, torch.float32, torch.device("cpu")))
"""


def test_without_compilers_the_compiled_step_attends_with_sdpa(tmp_path):
    # In a process of its own: this one may have registered the op already.
    env = {**os.environ, "CC": "false", "CXX": "false", "DECODERLM_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_COMPILERS], capture_output=True, text=True, env=env
    )
    assert done.stdout.split() == ["False"], done.stderr
