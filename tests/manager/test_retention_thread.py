"""The Checkpointer's retention thread: runs in order off the caller's thread, requests made
while a run waits to start join it, a failed run is logged and the next one still runs, nothing
runs after close()."""

from __future__ import annotations

import logging
import threading

from gdsckpt.manager.retention import RetentionThread


def test_requests_coalesce_and_runs_see_every_request(caplog):
    started, release = threading.Event(), threading.Event()
    runs = []

    def retain():
        runs.append(threading.current_thread().name)
        started.set()
        assert release.wait(30)
        if len(runs) == 2:
            raise OSError("disk gone")

    caplog.set_level(logging.WARNING, logger="gdsckpt.manager.checkpointer")
    rt = RetentionThread(retain)
    rt.request()
    assert started.wait(30)  # the first run is running: a request now needs a second run
    for _ in range(5):
        rt.request()  # the second run has not started: these join it
    release.set()
    rt.wait()
    assert len(runs) == 2 and all(name.startswith("gdsckpt-retention") for name in runs)
    assert "gdsckpt: retention: OSError: disk gone" in caplog.text
    rt.request()  # a failed run did not end the thread
    rt.wait()
    assert len(runs) == 3
    rt.close()
    rt.request()  # after close: nothing runs, nothing raises
    rt.wait()
    assert len(runs) == 3
