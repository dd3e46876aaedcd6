"""A free TCP port on this machine (for test servers: emulator, Ray, Slurm)."""

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
