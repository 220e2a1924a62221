"""Why staleness hurts: the largest stable step of SGD with Nesterov momentum on a quadratic.

    python bench/stability.py

On f(x) = lambda x^2 / 2 a step is stable while h = lr * lambda stays below an edge, and SGD
drives a network's sharpness (its largest lambda) up to that edge.  A gradient computed on
parameters some updates old moves the edge; this script computes it, exactly, from the
eigenvalues of the update as a linear map (numpy only, a second).

* the slides' rule: one momentum buffer, each gradient applied at the full rate as it comes,
  `delay` updates late (N workers of equal speed: delay N - 1)
* the script's rule (async_sgd_cifar100.py): N workers in turn, each update at lr / N, one
  Nesterov buffer per worker, the reply the parameters after the update; h is in the units
  of one sync step (lr), so one process is N = 1
* the same with the reply extrapolated over the updates in flight (the default), and with
  nothing stale (a control)
* the same, with the step lr (a g + b v_old) for other splits between the fresh gradient and
  the momentum, all moving a constant gradient equally far in the long run
"""
import numpy as np

MU = 0.9


def spectral_radius(m):
    return max(abs(np.linalg.eigvals(m)))


def edge(update, h_max=4.0, points=1500):
    """The first h on a grid (log-spaced, 0.6 % apart) where `update(h)` (a matrix) stops
    being a contraction."""
    for h in np.geomspace(1e-3, h_max, points):
        if spectral_radius(update(h)) >= 1.0:
            return h
    return h_max


def slides_rule(delay):
    """State [theta_t, ..., theta_{t - delay}, v]; g = h theta_{t - delay}."""
    def update(h):
        n = delay + 2
        m = np.zeros((n, n))
        g = np.zeros(n)
        g[delay] = h
        v_new = MU * np.eye(n)[n - 1] + g
        m[0] = np.eye(n)[0] - (g + MU * v_new)  # torch's Nesterov step
        for i in range(1, delay + 1):
            m[i, i - 1] = 1.0  # shift the history
        m[n - 1] = v_new
        return m
    return update


def per_worker_rule(workers, a=1 + MU, ahead=0, fresh=False):
    """One round of N updates; state [theta, v_1..v_N, held_1..held_N].  The reply is the
    parameters after the update, extrapolated `ahead` updates along the buffers (the script's
    --ahead); `fresh`: every worker holds the current parameters (nothing stale)."""
    b = 1 - a * (1 - MU)  # a + b / (1 - mu) = 1 / (1 - mu): the same long-run step

    def update(h):
        n = 1 + 2 * workers
        eye = np.eye(n)
        round_map = eye.copy()
        for i in range(workers):
            v, held = 1 + i, 1 + workers + i
            step = eye.copy()
            g = h * (eye[0] if fresh else eye[held])  # the gradient where worker i computes
            step[v] = MU * eye[v] + g
            step[0] = eye[0] - (a * g + b * eye[v]) / workers
            buffers = sum(step[1 + j] for j in range(workers))
            step[held] = step[0] - ahead / workers * buffers / workers  # the reply
            round_map = step @ round_map
        return round_map
    return update


def main():
    print("The slides' rule (one buffer, full rate), largest stable h = lr * lambda:")
    edges = {delay: edge(slides_rule(delay)) for delay in (0, 1, 3, 7)}
    for delay, h in edges.items():
        print(f"  delay {delay}: {h:.3f}" + (f"  ({edges[0] / h:.0f}x smaller)" if delay else ""))
    print("The script's rule (lr / N per update, a Nesterov buffer per worker), h in sync steps:")
    edges = {workers: edge(per_worker_rule(workers)) for workers in (1, 2, 4, 8)}
    for workers, h in edges.items():
        print(f"  {workers} worker(s): {h:.3f}  ({h / edges[1]:.2f} of one process's)")
    print("The same, the reply extrapolated N - 1 updates (the default, --ahead N - 1):")
    for workers in (2, 4, 8):
        h = edge(per_worker_rule(workers, ahead=workers - 1))
        print(f"  {workers} workers: {h:.3f}  ({h / edges[1]:.2f} of one process's)")
    print("The same with nothing stale (each gradient on the current parameters):")
    for workers in (2, 4, 8):
        h = edge(per_worker_rule(workers, fresh=True))
        print(f"  {workers} workers: {h:.3f}  ({h / edges[1]:.2f} of one process's)")
    print("The same rule with the step lr (a g + b v_old), 4 workers:")
    for a, name in ((1.0, "heavy ball"), (1 + MU, "Nesterov"), (3.0, ""),
                    (1 / (1 - MU), "no momentum")):
        print(f"  a = {a:.2f} {name:12s}: {edge(per_worker_rule(4, a)):.3f}")


if __name__ == "__main__":
    main()
