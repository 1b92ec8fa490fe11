"""Seeded fuzzers for kvstack's sockets (issue 18): generators, a runner, a soak entry point."""
