"""benchmarks/workload_floor.py's counts (CPU, meta-device models): the attention pairs against a
brute-force count, the linear layers' FLOPs against a hand count from the config, the W4 and W3
floors against the figures the issues computed independently, and a target verdict."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytest.importorskip("transformers")
from transformers import AutoConfig  # noqa: E402

import workload_floor as wf  # noqa: E402


def _pairs_brute_force(lengths, window):
    return sum(1 for n in lengths for i in range(n) for j in range(i + 1) if window is None or i - j < window)


@pytest.mark.parametrize("window", [None, 1, 2, 7, 64])
def test_attended_keys_equal_a_brute_force_count(window):
    rng = random.Random(window or 0)
    lengths = [1, 2, 5, 9] + [rng.randint(1, 40) for _ in range(6)]
    assert wf.attended_keys(lengths, window) == _pairs_brute_force(lengths, window)
    assert wf.attended_keys([], window) == 0


def _tiny_llama(**extra):
    return AutoConfig.for_model("llama", vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                                num_attention_heads=6, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
                                **extra)


def test_full_fine_tuning_counts_three_gemms_for_every_linear_layer_and_the_head():
    lengths = [1, 17, 30]
    tokens = sum(lengths)
    h, m, heads, kv, d, vocab, layers = 48, 80, 6, 2, 8, 101, 3
    per_layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * m  # q, k, v, o, gate, up, down
    floor = wf.dense_full_floor("W", _tiny_llama(), lengths)
    assert floor.gemm_flop == 6 * tokens * (layers * per_layer + h * vocab)
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    assert floor.attention_flop == layers * heads * pairs * 14 * d
    assert floor.tokens == tokens


def test_sliding_layers_count_only_their_window():
    lengths = [3, 40]
    config = _tiny_llama(sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    floor = wf.attention_flop(config, lengths)
    assert floor == 6 * 14 * 8 * (2 * _pairs_brute_force(lengths, 4) + _pairs_brute_force(lengths, None))


def test_lora_counts_frozen_projections_twice_adapters_three_times_and_no_input_gradient_for_layer_0_qkv():
    lengths = [5, 11]
    tokens = sum(lengths)
    h, m, heads, kv, d, vocab, layers, r = 48, 80, 6, 2, 8, 101, 3, 4
    shapes = [(h, heads * d), (h, kv * d), (h, kv * d), (heads * d, h), (h, m), (h, m), (m, h)]  # q k v o gate up down
    base = sum(i * o for i, o in shapes)
    adapters = sum(r * (i + o) for i, o in shapes)
    qkv = sum(i * o for i, o in shapes[:3])
    want = 4 * tokens * (layers * base + h * vocab) - 2 * tokens * qkv + 6 * tokens * layers * adapters
    assert wf.dense_lora_floor("W", _tiny_llama(), lengths, rank=r).gemm_flop == want


def test_w4_floor_is_the_30_8_gflop_a_token_issue_20_computed():
    """Issue 20 put W4's bound at about 25,700 tokens/s: 30.8 GFLOP a token at 792 TFLOP/s."""
    import lora_sft
    import packed_sft

    lengths = [len(s) for s in packed_sft.make_samples()]
    floor = wf.dense_lora_floor("W4", lora_sft.llama_8b(), lengths)
    assert floor.flop_per_token() == pytest.approx(30.8e9, rel=5e-3)
    assert floor.tokens / floor.seconds() == pytest.approx(25_700, rel=5e-3)


def test_qwen3_moe_block_floor_is_the_4_7_ms_issue_18_computed():
    import moe_block

    floor = wf.moe_block_floor("qwen3_30b_a3b", moe_block.block_config("qwen3_30b_a3b"), 16384)
    routed = 16384 * 8 * 3 * 2048 * 768
    assert floor.gemm_flop == 3 * 2 * (routed + 16384 * 2048 * 128)
    assert floor.seconds() == pytest.approx(4.7e-3, rel=1e-2)


def test_shared_experts_are_counted_on_every_token():
    import moe_block

    config = moe_block.block_config("deepseek_v2_lite")
    floor = wf.moe_block_floor("deepseek_v2_lite", config, 10)
    assert floor.gemm_flop == 3 * 2 * 10 * (6 * 3 * 2048 * 1408 + 3 * 2048 * 2 * 1408 + 2048 * 64)


def test_each_target_states_the_matrix_rate_it_needs_and_what_that_rate_means():
    floor = wf.Floor("W1-x", gemm_flop=792e12 * 0.4, attention_flop=0.0, tokens=100)  # 0.4 s at 792 TFLOP/s
    rows = {"hasten": {"run_id": "r", "step_s": 0.5}, "hasten_unfused": {"run_id": "r", "step_s": 0.7}}

    def line(target):
        return wf.report(floor, rows, [target], 792.0)[-1]

    # 2x of a 0.7 s step: 0.35 s for 316.8 TFLOP, 905 TFLOP/s, above what these boards ran, below the datasheet
    assert "(350.00 ms a step, measured 1.40x): needs its products at 905 TFLOP/s" in line(wf.Target("hasten", 2.0, "hasten_unfused"))
    assert "above every bf16 GEMM rate measured" in line(wf.Target("hasten", 2.0, "hasten_unfused"))
    assert line(wf.Target("hasten", 1.5, "hasten_unfused")).endswith("85% of the measured GEMM ceiling")
    assert "cannot be met: above the chip's dense bf16 peak" in line(wf.Target("hasten", step_s=0.3))
    assert line(wf.Target("hasten", 2.0, "liger")).endswith("no liger row")
