"""The load generator (streaming completions, timing, statistics) and a load measured against a server's sampler."""
