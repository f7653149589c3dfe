"""The docs' report commands (kvtier_tools.bench.report_*, vllm_report --cold) over records
committed in results/: each table shows what its record holds, with the machine and date,
and each figure is an SVG that names its machine, date and the command that made it."""

import xml.etree.ElementTree as ET
from pathlib import Path

from kvtier_tools.bench import report_disk, report_pd, report_stores, vllm_report
from kvtier_tools.bench.records import find, gpus, read

RESULTS = Path(__file__).resolve().parents[1] / "results"


def test_a_record_gzipped_in_place_is_found_and_read_by_its_json_name():
    path = RESULTS / "gpu2-h200x2-2026-11-28b/pd-2gpu.json"
    assert find(path).name == "pd-2gpu.json.gz"
    assert read(path)["date"] == "2026-11-28"
    assert gpus(path.parent) == "2 × NVIDIA H200"


def test_the_pd_transfer_table_gives_each_variants_paired_ratio_to_the_copy():
    table = report_pd.transfer_table(RESULTS / "gpu2-h200x2-2026-11-28b/pd-2gpu.json")
    # 32k tokens behind a forward: 12.20 ms, the median of each repeat's copy / send 0.921
    row = next(r for r in table.splitlines() if "forward" in r and "32,768" in r)
    assert "| 12.20 |" in row and "| 0.921 |" in row and "| 11.15 |" in row
    assert "2 × NVIDIA H200, 2026-11-28" in table


def test_the_pd_vllm_table_gives_the_proxys_ttft_against_the_decoder_alone():
    table = report_pd.vllm_table([RESULTS / "gpu2-h200x2-2026-11-28/pd-vllm.json"])
    row = next(r for r in table.splitlines() if "32,768" in r)
    assert "| 771.2 | 695.1 |" in row and "| 3/3 |" in row


def test_the_store_tables_give_each_targets_speed_and_the_records_own_ratios():
    table = report_stores.server_table(RESULTS / "cpu-2core-2026-11-22/server.json")
    row = next(r for r in table.splitlines() if r.startswith("| 2 MiB | 1 | put"))
    assert "| 4.86 |" in row and "| 1.13 (1.10) |" in row and "| 3.16 (3.33) |" in row
    assert "p99 0.186 ms" in table
    shared = report_stores.vllm_table(
        RESULTS / "gpu-h100-vllm-2026-11-27/shared-store/shared-store-f.json"
    )
    assert "| kvtier server | 321.9 / 309.3 | 173.3 / 169.3 |" in shared


def test_the_disk_tables_give_the_tier_against_a_file_and_warm_ttft_from_disk():
    tier = report_disk.tier_table([RESULTS / "gpu-h100-2026-11-23/disk.json"])
    assert "| read | 1.63 (1.56-1.80) | 1.56 (1.41-1.76) | 1.04 | 1,727 / 0.010 |" in tier
    ttft = report_disk.ttft_table(RESULTS / "gpu-h100-2026-11-23/disk-ttft/ttft.json")
    assert "| warm from disk | 1,432 |" in ttft and "| 1.011 |" in ttft


def test_the_cold_table_compares_each_setups_miss_with_plain_vllms():
    table = vllm_report.cold_markdown(
        RESULTS / "gpu-h100-vllm-2026-11-27/paired-serving-query-twice",
        ["query-twice-plain", "query-twice-kvtier", "query-twice-lmcache"],
    )
    assert "| kvtier | 16,384 | 490.4 | 486.8-492.8 | 0.987 | yes |" in table
    assert "| lmcache | 32,768 | 1360.3 |" in table
    assert "NVIDIA H100 80GB HBM3, 2026-11-27, medians of 7 pairs." in table


def test_a_figure_names_its_machine_date_and_command(tmp_path):
    out = tmp_path / "pd.svg"
    note = "python -m kvtier_tools.bench.report_pd transfer RECORD --plot pd.svg"
    report_pd.transfer_plot(RESULTS / "gpu2-h200x2-2026-11-28b/pd-2gpu.json", out, note)
    svg = ET.fromstring(out.read_text())
    texts = [t.text or "" for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert any("2 × NVIDIA H200, 2026-11-28" in t for t in texts)
    assert any(note in t for t in texts)
    assert "0.92" in texts  # 32k tokens behind a forward
