"""Hypothesis strategies for op shapes: small, odd sizes included, divisibility kept valid."""

from hypothesis import strategies as st

batch = st.integers(1, 3)
length = st.integers(1, 7)
width = st.integers(1, 9)
even_head_dim = st.integers(1, 4).map(lambda n: 2 * n)
seed = st.integers(0, 2**16)
