"""Measured benchmarks of TensorHub (DESIGN.md section 8).

``python -m benchmarks`` runs the suite that puts TensorHub side by side with the alternatives
(``benchmarks/suite.py``); the other modules here are scripts run as ``python benchmarks/NAME.py``
and the emulated cluster they share.
"""
