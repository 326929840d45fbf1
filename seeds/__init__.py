"""Dataset generators for the demo, tests, benchmarks and the compose stack.

``shardfeed.seeds.synthetic``: a deterministic synthetic dataset whose bytes can be
recomputed from ``(seed, i)``; ``shardfeed.seeds.digits``: scikit-learn's bundled digits.
Import the module you need (both need the server extras).
"""
