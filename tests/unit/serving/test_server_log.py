"""What a failed tritonserver start reports: its error lines, wherever glog puts them."""

from __future__ import annotations

from pipeline.serving.server import log_errors

LOG = [
    "I1203 05:40:01.000000 123 server.cc:674] model loaded",
    "W1203 05:40:01.100000 123 metrics.cc:811] Unable to get power limit for GPU 0 (NVML not found)",
    "E1203 05:40:02.000000 123 main.cc:245] failed to start HTTP service: Address already in use",
    "  F1203 05:40:02.100000 123 server.cc:99] fatal: cannot continue",
    "I1203 05:40:02.200000 123 server.cc:300] Timeout 30: Found 0 live models and 0 in-flight",
]


def test_error_lines_at_column_zero_and_indented_are_found():
    assert log_errors(LOG) == [LOG[2], LOG[3]]


def test_info_and_warning_lines_are_not_errors():
    assert log_errors(LOG[:2] + LOG[4:]) == []
