"""tools/bench_versions.py: runs two checkouts interleaved and reports their ratio; refuses a folder
that is not a checkout. tools/bench_decode.py: the FLOPs its prefill roofline counts. (The tools'
figures are measurements, never asserted.) tools/benchkit.py: the FLOPs a training step's roofline
and its GEMM floor count."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_tool(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "bench_versions.py"), *args], capture_output=True,
                          text=True, timeout=300)


def test_bench_versions_compares_two_checkouts_interleaved(tmp_path):
    done = run_tool("--other", str(ROOT), "--rounds", "2", "--seconds", "0.1", "--train", "p", "--decode", "15M",
                    "--models-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert f"decode 15M skipped: {tmp_path / '15M.safetensors'} is missing" in done.stdout
    assert "round 2/2 done" in done.stdout
    row = re.search(r"^train p\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)$", done.stdout, re.M)
    assert row, done.stdout
    this, other, ratio = (float(g.replace(",", "")) for g in row.groups())
    assert this > 0 and other > 0 and abs(ratio - this / other) < 1e-3 * ratio + 1e-3


def test_bench_versions_refuses_a_folder_that_is_not_a_checkout(tmp_path):
    done = run_tool("--other", str(tmp_path))
    assert done.returncode == 2 and "not an npllama checkout" in done.stderr, done.stderr


def test_bench_decode_counts_a_prefill_s_flops_matmul_by_matmul():
    """The prefill roofline's FLOPs: each projection at each position, causal attention's q k^T and
    P v per head over the keys up to the query, and the classifier at the last position only."""
    sys.path.insert(0, str(ROOT))
    from tools.bench_decode import prefill_flops
    import npllama
    cfg = npllama.LlamaConfig(dim=48, n_layers=3, n_heads=6, n_kv_heads=2, vocab_size=70, max_seq_len=32)
    D, Dh, H, KVH, F, V = cfg.dim, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.hidden_dim, cfg.vocab_size
    T = 11
    per_position = {"wq": D * H * Dh, "wk": D * KVH * Dh, "wv": D * KVH * Dh, "wo": H * Dh * D,
                    "w1": D * F, "w3": D * F, "w2": F * D}
    expected = 0
    for _ in range(cfg.n_layers):
        for t in range(T):
            expected += sum(2 * macs for macs in per_position.values())
            expected += H * (2 * Dh * (t + 1) + 2 * Dh * (t + 1))          # q k^T over keys 0..t, then P v
    expected += 2 * D * V                                                  # the last position's logits
    assert prefill_flops(cfg, T) == expected


def test_the_training_gemm_floor_runs_exactly_the_linear_layers_matmuls_of_a_step():
    """benchkit.linear_gemm_floor: per weight (n, m), forward x W^T and backward's dy W and dy^T x
    over each worker's rows; together 3x the linear layers' forward FLOPs, which linear_flops counts
    weight by weight. Fused as the engine fuses them: q|k|v and w1|w3, one matrix each."""
    sys.path.insert(0, str(ROOT))
    from tools.benchkit import linear_flops, linear_gemm_floor
    import npllama
    cfg = npllama.LlamaConfig(dim=48, n_layers=3, n_heads=6, n_kv_heads=2, vocab_size=70, max_seq_len=32)
    D, Dh, H, KVH, F, V = cfg.dim, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.hidden_dim, cfg.vocab_size
    B, T = 3, 10
    weights = {"wq": D * H * Dh, "wk": D * KVH * Dh, "wv": D * KVH * Dh, "wo": H * Dh * D,
               "w1": D * F, "w3": D * F, "w2": F * D}
    assert linear_flops(cfg, B * T) == 2 * B * T * (cfg.n_layers * sum(weights.values()) + D * V)
    for workers in (1, 2, 3):
        step = linear_gemm_floor(cfg, B, T, workers)
        step()
        assert len(step.operands) == workers
        rows = [x.shape[0] for ops in step.operands for x, _, _ in ops]
        assert set(rows) == {B * T // workers}
        for x, w, dy in (op for ops in step.operands for op in ops):
            assert x.shape[1] == w.shape[1] and dy.shape == (x.shape[0], w.shape[0])     # x W^T, dy W, dy^T x
        flops = sum(3 * 2 * x.shape[0] * w.size for ops in step.operands for x, w, _ in ops)
        assert flops == 3 * linear_flops(cfg, B * T)
        assert [w.shape for _, w, _ in step.operands[0]] == (
            [((H + 2 * KVH) * Dh, D), (D, H * Dh), (2 * F, D), (D, F)] * cfg.n_layers + [(V, D)])


def test_the_matmul_exp_floor_adds_the_attention_s_block_matmuls_and_one_exp_per_score_gate_and_logit():
    """benchkit.matmul_exp_floor: the linear floor's matmuls, then per layer the attention's six
    products over each query block's (block, e) tiles, and one exp per causal score, gate and logit;
    its counts are attention_block_flops and training_exps, which count independently here."""
    sys.path.insert(0, str(ROOT))
    import numpy as np
    from tools.benchkit import attention_block_flops, linear_gemm_floor, matmul_exp_floor, training_exps
    import npllama
    cfg = npllama.LlamaConfig(dim=48, n_layers=3, n_heads=6, n_kv_heads=2, vocab_size=70, max_seq_len=40)
    Dh, H, KVH, F, V, L = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.hidden_dim, cfg.vocab_size, cfg.n_layers
    B, T, block = 4, 37, 16                                   # blocks [0, 16), [16, 32), [32, 37)
    scores = sum(t + 1 for t in range(T))                     # the causal ones, per head
    tiles = 16 * 16 + 16 * 32 + 5 * 37                        # every block's rows x the keys up to its end
    assert training_exps(cfg, B, T) == B * (L * (H * scores + T * F) + T * V)
    assert attention_block_flops(cfg, B, T, block) == 6 * 2 * Dh * B * H * L * tiles
    for workers in (1, 2):
        step = matmul_exp_floor(cfg, B, T, workers, block=block)
        step()
        assert step.attention_flops == attention_block_flops(cfg, B, T, block)
        assert step.exps == training_exps(cfg, B, T)
        assert len(step.operands) == workers
        rows = B // workers
        for ops in step.operands:
            assert ops["q"].shape == (rows, KVH, T * H // KVH, Dh)
            assert ops["k"].shape == ops["v"].shape == (rows, KVH, T, Dh)
            assert {name: ops[name][0].size for name in ("scores", "gates", "logits")} == {
                "scores": rows * H * scores, "gates": rows * T * F, "logits": rows * T * V}
            for name in ("scores", "gates", "logits"):         # the exps were run, into their own arrays
                np.testing.assert_array_equal(ops[name][1], np.exp(ops[name][0]))
        linear = linear_gemm_floor(cfg, B, T, workers)        # the same linear matmuls underneath
        assert [[x.shape for x in op] for op in step.linear.operands[0]] == [[x.shape for x in op]
                                                                           for op in linear.operands[0]]


def test_the_adamw_traffic_floor_updates_every_chunk_once_reading_p_g_m_v_and_writing_p_m_v():
    """benchkit.adamw_traffic_floor: m += g, v += g, p += m on every chunk (engine/adamw.py's CHUNK) of
    the flat arrays, each chunk by exactly one thread: a chunk run twice or skipped shows in the
    sums. Its traffic counts 7 x 4 bytes a parameter. training_floor runs matmul_exp_floor's work,
    then this over the model's parameters."""
    sys.path.insert(0, str(ROOT))
    import numpy as np
    from npllama.engine.adamw import CHUNK
    from tools.benchkit import adamw_traffic_floor, training_floor
    import npllama
    n = 2 * CHUNK + 1001                                      # three chunks, the last a short one
    for threads in (1, 2, 3, 4):
        step = adamw_traffic_floor(n, threads)
        p, g, m, v = step.arrays
        p0, g0, m0, v0 = (a.copy() for a in step.arrays)
        step()
        m1 = m0 + g0
        np.testing.assert_array_equal(m, m1)
        np.testing.assert_array_equal(v, v0 + g0)
        np.testing.assert_array_equal(p, p0 + m1)
        np.testing.assert_array_equal(g, g0)
        assert step.bytes == 7 * 4 * n
    cfg = npllama.LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, max_seq_len=16)
    step = training_floor(cfg, 2, 16, 2)
    m_before = step.adamw.arrays[2].copy()
    step()
    assert step.adamw.arrays[0].size == cfg.n_params()
    np.testing.assert_array_equal(step.adamw.arrays[2], m_before + step.adamw.arrays[1])
    np.testing.assert_array_equal(step.matmul_exp.operands[0]["gates"][1], np.exp(step.matmul_exp.operands[0]["gates"][0]))
