"""The fault tier's own fixtures (`fixtures.fault_backends`): emulator processes to kill and
stop, a network namespace to cut, raw backends that drip, send garbage or cut a chunk."""

from fixtures.fault_backends import netns_link, start_emulator_process, start_raw_backend

__all__ = ["netns_link", "start_emulator_process", "start_raw_backend"]
