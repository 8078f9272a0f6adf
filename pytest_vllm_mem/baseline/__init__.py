"""Baselines and the gate's arithmetic: metrics, test records, the baseline file, comparison, the noise judge.

Pure: no process, no pytest.
"""
