"""bench/README.md generation from hand-written result files: every comparison row carries ours, the peer, the
ratio (ours ahead when above 1), the machine and the command; rows behind are listed; plots are written."""
import json

from mplug_pretrain.bench.report import write_report

MACHINE = {"hostname": "box", "cpu": "Test CPU", "cpu_count": 2, "torch_threads": 2, "torch": "2.13.0", "gpu": None}


def _write(folder, name, rows, **extra):
    (folder / f"{name}.json").write_text(json.dumps({"bench": name, "machine": MACHINE, "rows": rows, **extra}))


def test_report_rows_ratios_and_plots(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    _write(results, "data_peer", [{"workers": 1, "ours_samples_per_s": 300.0, "open_clip_samples_per_s": 200.0,
                                   "ratio": 1.5, "timed_batches": 60}], batch_size=32, image_size=64)
    _write(results, "attention_peer", [{"module": "text_encoder", "layers": 6, "batch": 8, "tokens": 30,
                                        "width": 768, "ours_seconds": 0.5, "transformers_seconds": 0.4,
                                        "ratio": 0.8, "transformers_attn_implementation": "sdpa"}])
    ts = [{"preset": "tiny", "ranks": 2, "zero_stage": s, "grad_checkpointing": False, "batch_per_rank": 16,
           "step_seconds": 1.0, "samples_per_s": 32.0, "peak_rss_mb": 900.0, "state_parameters_bytes": 4 * 2**20,
           "state_gradients_bytes": 4 * 2**20, "state_optimizer_bytes": 8 * 2**20, "state_other_bytes": 0,
           "state_total_bytes": total * 2**20, "state_total_vs_zero0": total / 16} for s, total in ((0, 16), (3, 8))]
    _write(results, "train_step", ts)
    text = write_report(str(results), str(tmp_path / "README.md"), str(tmp_path / "plots"), "a finding")
    table = [line for line in text.splitlines() if line.startswith(("| data", "| attention", "| memory"))]
    assert len(table) == 3
    data, attention, memory = table
    assert "| 300 |" in data and "200" in data and "1.50x" in data and "box: Test CPU" in data
    assert "`mplug bench data-peer --out bench/results/data_peer.json`" in data
    assert "0.80x" in attention and "ZeRO-3 vs ZeRO-0" in memory and "2.00x" in memory
    assert "Rows where ours is behind: attention" in text and "a finding" in text
    assert (tmp_path / "plots" / "train_step_vs_zero_stage.png").stat().st_size > 1000


def test_generation_rows_compare_the_packed_decoder_with_transformers_and_with_plain_weights(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    row = {"implementation": "ours", "decoder": "bert", "beam": 1, "cache": True, "parameters": 10}
    _write(results, "generate", [{**row, "captions_per_s": 6.0, "packed": True, "first_call_captions_per_s": 5.0},
                                 {**row, "captions_per_s": 4.0, "packed": False},
                                 {**row, "implementation": "transformers", "captions_per_s": 3.0}])
    text = write_report(str(results), str(tmp_path / "README.md"), str(tmp_path / "plots"), "a finding")
    rows = [line for line in text.splitlines() if line.startswith("| generation")]
    assert len(rows) == 2
    packed_vs_plain, versus_peer = sorted(rows, key=lambda line: "transformers" in line)
    assert "packed vs plain" in packed_vs_plain and "1.50x" in packed_vs_plain
    assert "| 6 |" in versus_peer and "transformers 3" in versus_peer and "2.00x" in versus_peer
    assert (tmp_path / "plots" / "decode_speed_vs_beam.png").stat().st_size > 1000


def test_gpu_train_step_table_gives_the_largest_batch_its_memory_and_mfu(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    gpu = {**MACHINE, "gpu": "Test GPU"}
    rows = [{"preset": "base", "zero_stage": 2, "grad_checkpointing": False, "batch_per_rank": 128, "step_seconds": 0.5,
             "samples_per_s": 256.0, "peak_gpu_memory_mb": 3 * 1024.0, "mfu": 0.125, "oom_at": 256},
            {"preset": "large", "zero_stage": 0, "grad_checkpointing": True, "batch_per_rank": 1024, "step_seconds": 4.0,
             "samples_per_s": 256.0, "peak_gpu_memory_mb": 1536.0, "mfu": 0.25, "oom_at": None}]
    (results / "train_step_gpu.json").write_text(json.dumps({"bench": "train_step", "machine": gpu, "rows": rows,
                                                              "note": "two leases"}))
    text = write_report(str(results), str(tmp_path / "README.md"), str(tmp_path / "plots"))
    assert "## Pretraining step on a GPU (bf16)" in text and "box: Test GPU" in text and "two leases" in text
    table = [line for line in text.splitlines() if line.startswith(("| base", "| large"))]
    assert table == ["| base | 2 | off | 128 (256 OOM) | 0.500 | 256 | 3.0 GiB | 12.5 % |",
                     "| large | 0 | on | 1024 (limit, no OOM) | 4.000 | 256 | 1.5 GiB | 25.0 % |"]


def test_gpu_lease_table_leaves_out_failed_cases_and_gives_buckets_in_ms(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    gpu = {**MACHINE, "gpu": "Test GPU"}
    ok = {"label": "after", "preset": "base", "zero_stage": 2, "compile": True, "step_seconds": 0.25,
          "samples_per_s": 512.0, "mfu": 0.2, "mfu_real_length": 0.175,
          "profile": {"buckets_s": {"matmul": 0.1, "attention": 0.04, "elementwise": 0.05, "copies": 0.03,
                                    "optimizer": 0.01, "idle": 0.0}}}
    failed = {"label": "after", "preset": "large", "zero_stage": 2, "compile": True, "error": "exit 1 after 31 s"}
    (results / "gpu_lease_after.json").write_text(json.dumps({"machine": gpu, "rows": [ok, failed], "note": "one lease"}))
    text = write_report(str(results), str(tmp_path / "README.md"), str(tmp_path / "plots"))
    assert "## GPU lease: after" in text and "one lease" in text
    table = [line for line in text.splitlines() if line.startswith("| after")]
    assert table == ["| after | base | 2 | compiled | 0.250 | 512 | 20.0 % | 17.5 % | 100 / 40 / 50 / 30 / 10 / 0 |"]
