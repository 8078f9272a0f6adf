"""The memory plan before any server starts: model figures, the plan, calibrations, planning a suite's configs.

Pure: no process, no pytest.
"""
