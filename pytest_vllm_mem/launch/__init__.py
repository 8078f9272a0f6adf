"""Starting, watching and stopping vLLM servers: the only code that spawns or kills processes.

A cluster launcher plugs in here.
"""
