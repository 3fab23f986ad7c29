"""StackThread.stop when the stack does not stop: it says so, with every thread's stack."""

from __future__ import annotations

import threading

import pytest

from stateblock.app.stack import StackThread, UpConfig


def test_a_stop_that_times_out_dumps_every_threads_stack_then_raises(tmp_path, capfd):
    release = threading.Event()

    def stuck_in_shutdown() -> None:  # stands in for a stack whose teardown hangs
        release.wait(30)

    st = StackThread(UpConfig(data_dir=tmp_path))
    st._thread = threading.Thread(target=stuck_in_shutdown, name="stack", daemon=True)
    st._thread.start()
    try:
        with pytest.raises(RuntimeError, match="did not stop within 0.2 s"):
            st.stop(timeout=0.2)
    finally:
        release.set()
        st._thread.join(5)
    err = capfd.readouterr().err
    assert "stuck_in_shutdown" in err  # the hung thread's frame, named
    assert "test_a_stop_that_times_out" in err  # and the caller's: every thread
