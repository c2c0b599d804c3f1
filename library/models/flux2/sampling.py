"""FLUX.2's resolution shift: the pipelines pass the scheduler (use_dynamic_shifting, exponential)
mu = compute_empirical_mu(image_seq_len, num_steps) (diffusers pipeline_flux2*.py, BFL's flux2
sampling.py) instead of a line in the token count alone. Pure Python: the spec names it and the
command lines read the spec before torch loads."""


def compute_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """The mu lines fitted at 10 and 200 steps, interpolated linearly in num_steps; above 4300
    tokens the 200-step line alone."""
    a1, b1 = 8.73809524e-05, 1.89833333  # the 10-step line
    a2, b2 = 0.00016927, 0.45666666  # the 200-step line
    m_200 = a2 * image_seq_len + b2
    if image_seq_len > 4300:
        return float(m_200)
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    return float(a * num_steps + (m_200 - 200.0 * a))
