"""Training tiny-16 (replay/train.py): the fake-quantized dense forward is the inference model, the indexer
learns, a CPU smoke run works, and the committed checkpoint's held-out bits per byte reproduce."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore.format import quant
from replay import dense
from replay.calibration import Calibration, CalibrationRow
from replay.corpus import split_bytes
from replay.fakequant import fq_indexer, fq_main, fq_swa
from replay.model import ModelArgs, Transformer
from replay.train import SLICE_WINDOWS, TrainConfig, bits_per_byte, lm_loss, train
from replay.weights import DEFAULT_CHECKPOINT

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def grad_enabled() -> Iterator[None]:
    """Other modules' tests run code that turns autograd off for the process (the demo, the benchmarks)."""
    with torch.enable_grad():
        yield
#: the card's stated tolerance between the CPU recomputation and the GPU's float32 slice evaluation
BPB_TOLERANCE = 0.01


@pytest.mark.parametrize("fq, q, dq", [(fq_main, quant.quantize_main, quant.dequantize_main),
                                      (fq_indexer, quant.quantize_indexer, quant.dequantize_indexer),
                                      (fq_swa, quant.quantize_swa, quant.dequantize_swa)])
def test_fake_quant_is_the_codec_round_trip(fq, q, dq) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g) * torch.logspace(-4, 3, 256)[:, None]
    x[0, :4] = torch.tensor([0.75, -1.75, 3.5, 0.25])  # ties
    assert torch.equal(fq(x), dq(*q(x), torch.float32))
    y = x.clone().requires_grad_()
    fq(y).sum().backward()
    assert torch.equal(y.grad, torch.ones_like(x))  # straight through


def _logits_match(model: Transformer, toks: torch.Tensor, dfrom: list[int]) -> None:
    with torch.no_grad():
        out = dense.forward(model, toks, torch.tensor(dfrom)).logits
    for b, d in enumerate(dfrom):
        ref = model.decode_tokens(toks[b], model.new_state(), decoder_from=d, chunk_size=512)
        torch.testing.assert_close(out[b, d:], ref, rtol=0, atol=1e-5)


def test_dense_forward_matches_run_on_the_same_weights() -> None:
    model = Transformer(ModelArgs.tiny8(top_k=8, pool_blocks=4), seed=1)  # selection and pool bite at T=300
    toks = torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(0))
    _logits_match(model, toks, [0, 170])


@pytest.mark.skipif(not DEFAULT_CHECKPOINT.exists(), reason="no trained checkpoint")
def test_dense_forward_matches_run_on_the_trained_checkpoint() -> None:
    model = Transformer.load_checkpoint(DEFAULT_CHECKPOINT)
    toks = torch.tensor(list(split_bytes("heldout", 2 * 400))).view(2, 400)
    _logits_match(model, toks, [0, 250])


def test_only_the_index_kl_reaches_the_indexer() -> None:
    model = Transformer(ModelArgs.tiny8(top_k=8, pool_blocks=4), seed=1)
    toks = torch.randint(0, 256, (1, 97), generator=torch.Generator().manual_seed(1))
    indexer = [n for n, _ in model.named_parameters() if ".indexer." in n or ".wik." in n]
    for with_kl in (False, True):
        model.zero_grad(set_to_none=True)
        out = dense.forward(model, toks[:, :-1], with_index_kl=with_kl)
        (lm_loss(out.logits, toks[:, 1:], torch.tensor([0])) + out.index_kl).backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert all((grads[n] is not None and bool(grads[n].abs().sum() > 0)) == with_kl for n in indexer)
        assert all(g is not None for n, g in grads.items() if n not in indexer)


def test_cpu_smoke_run_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    data = torch.frombuffer(bytearray(split_bytes("train", 20_000)), dtype=torch.uint8)
    held = torch.frombuffer(bytearray(split_bytes("heldout", 2_000)), dtype=torch.uint8)
    cfg = TrainConfig(model="tiny-8", seq_len=128, batch=2, steps=2, min_decoder_span=32, eval_windows=1,
                      log_every=1)
    res = train(cfg, data, held, tmp_path, torch.device("cpu"))
    assert res["steps"] == 2 and res["heldout_bpb"] > 0
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 2
    model = Transformer.load_checkpoint(tmp_path / "tiny8.safetensors")
    assert model.args == ModelArgs.tiny8() and model.output.weight.dtype == torch.float32


@pytest.mark.skipif(not DEFAULT_CHECKPOINT.exists(), reason="no trained checkpoint")
def test_checkpoint_card_held_out_bits_per_byte_reproduce() -> None:
    card = json.loads(DEFAULT_CHECKPOINT.with_name("tiny16-stdlib.eval.json").read_text())
    model = Transformer.load_checkpoint(DEFAULT_CHECKPOINT)
    seq = card["seq_len"]
    held = torch.frombuffer(bytearray(split_bytes("heldout", SLICE_WINDOWS * seq + 1)), dtype=torch.uint8)
    got = bits_per_byte(model, held, seq, SLICE_WINDOWS, batch=SLICE_WINDOWS)
    assert abs(got - card["slice_bpb_fp32"]) < BPB_TOLERANCE, (got, card["slice_bpb_fp32"])


def test_calibration_picks_the_smallest_length_that_stays_within_budget(tmp_path: Path) -> None:
    rows = tuple(CalibrationRow(r, kl, 10 * kl, 1.0) for r, kl in ((1, 0.1), (64, 0.01), (128, 2e-3),
                                                                    (192, 3e-3), (256, 5e-4), (512, 0.0)))
    cal = Calibration("w", 4096, 4, rows)
    cal.save(tmp_path / "c.json")
    assert Calibration.load(tmp_path / "c.json") == cal
    assert cal.pick(1e-3).replay_tokens == 256  # 128 meets 2e-3 but 192 does not: not trusted
    assert cal.pick(5e-3).replay_tokens == 128
    assert cal.expected(200).replay_tokens == 192 and cal.expected(0).replay_tokens == 1
    with pytest.raises(ValueError):
        Calibration("w", 1, 1, rows[:2]).pick(1e-3)
