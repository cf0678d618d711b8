"""A signal handler `appliance serve` cannot install is logged with what it costs, never silently absent
(appliance/daemon.py install_signal_handlers). `appliance serve` runs its loop in the main thread of a Linux
process, where every handler installs; a loop in another thread is where asyncio refuses them, so that is where the
refusal is made here."""
from __future__ import annotations

import asyncio
import logging
import signal
import threading

from appliance.daemon import install_signal_handlers


def test_handlers_install_on_the_main_threads_loop(caplog):
    async def main():
        loop = asyncio.get_running_loop()
        try:
            return install_signal_handlers(loop, {signal.SIGHUP: (lambda: None,), signal.SIGTERM: (lambda: None,)})
        finally:
            loop.remove_signal_handler(signal.SIGHUP)
            loop.remove_signal_handler(signal.SIGTERM)
    with caplog.at_level(logging.ERROR, logger="appliance.daemon"):
        assert asyncio.run(main()) == []
    assert not caplog.records


def test_a_handler_that_cannot_be_installed_is_logged_with_its_cost(caplog):
    result = {}

    def in_thread():
        async def main():
            return install_signal_handlers(asyncio.get_running_loop(), {
                signal.SIGTERM: (lambda: None,), signal.SIGHUP: (lambda: None,)})
        result["missing"] = asyncio.run(main())
    with caplog.at_level(logging.ERROR, logger="appliance.daemon"):
        worker = threading.Thread(target=in_thread)
        worker.start()
        worker.join(60)
    assert result["missing"] == [signal.SIGTERM, signal.SIGHUP]
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(lines) == 2, lines
    assert "cannot install the SIGTERM handler" in lines[0] and "`systemctl stop` will not drain calls" in lines[0]
    assert "cannot install the SIGHUP handler" in lines[1] and "will not re-read the configuration" in lines[1]
