"""Measurements on real hardware: the profiler behind ``attnpool profile``."""
