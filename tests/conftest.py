"""Shared by every test directory: with ATTNPLUG_FAIL_LOG=PATH, each failure's traceback is appended to
PATH as it happens (under pytest-xdist, by the controller), so a GPU call cut by its time limit still
brings back why its failed tests failed."""

import os


def pytest_runtest_logreport(report):
    path = os.environ.get("ATTNPLUG_FAIL_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} [{report.when}]\n{report.longreprtext}\n\n")
