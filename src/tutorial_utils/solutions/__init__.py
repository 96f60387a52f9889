"""Solutions to the chapters' exercises, one module per chapter (``ch03b`` for chapter 3b).

Each chapter's exercises name the function that solves them here; ``tests/test_exercises.py``
runs every one. A solution that is one call of the package's own code says so and makes the call.
"""
