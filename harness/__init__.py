"""Process harnesses the tests and the benchmarks share (not part of the package).

- :mod:`harness.ranks`: runs a function on N spawned ranks joined by a real gloo process group.
- :mod:`harness.jobs`: runs subprocess jobs (each in a session of its own, killed as a group on
  timeout) a few at a time, and blocking calls on threads.
"""
