"""free_port(): a TCP port on 127.0.0.1 for a test's server, shared by the
Python tests (conftest.py) and the shell harness (lib.sh's rl_free_port)."""

import random
import socket


def _listen_ports():
    """The ports free_port() picks from: below the kernel's range for the
    local end of outgoing connections, where no client of a test can take a
    port between free_port() and the server's bind (a PostgreSQL started on
    59379 failed so once in make test-matrix). None if that range starts too
    low to leave room."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (10000, low) if low >= 12000 else None


_LISTEN_PORTS = _listen_ports()


def free_port():
    """A port on 127.0.0.1 that nobody listens on now (another test run may
    still take it: servers started on it retry with another)."""
    for _ in range(100 if _LISTEN_PORTS else 0):
        s = socket.socket()
        try:
            port = random.randrange(*_LISTEN_PORTS)
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
        finally:
            s.close()
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
    finally:
        s.close()


if __name__ == "__main__":
    print(free_port())
