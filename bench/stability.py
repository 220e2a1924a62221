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

Then the noise floor: with independent noise on every gradient (batch B / N: N times one
process's variance), the stationary variance of the parameters the gradients are computed on,
along a direction with a given h, relative to one process's (the loss the noise keeps SGD at).
Along the bulk of directions (small h) it orders the rules as the simulator's accuracies do
(BENCHMARKS.md), and it bounds what any reply of this family can win.

Last, the pull (async_sgd_cifar100.py --pull P): each update also moves the parameters P / N
of the way back to those its gradient was computed on.  With the reply extrapolated, what the
parameters moved beyond the reply's forecast is mostly the other workers' gradient noise, and
in sharp directions the delayed feedback amplifies it.  Stationary variance alone cannot judge
a damping (a step of zero has none), so the pull is scored by the loss after as many rounds as
the yardstick's 6 epochs have (600), from a unit offset, with gradient noise: bias (progress)
and variance together, along directions from h = 1e-4 (barely trained) to 0.6, relative to
one process.
"""
import argparse

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


def per_worker_steps(workers, h, a=1 + MU, ahead=0, fresh=False, pull=0.0):
    """The N updates of one round as matrices on the state [theta, v_1..v_N, held_1..held_N]
    (held_i: the parameters worker i computes on), and for each update the direction in which
    its gradient's noise enters the state (wherever g does).  The reply is the parameters after
    the update, extrapolated `ahead` updates along the buffers (the script's --ahead); `fresh`:
    every worker computes on the current parameters (nothing stale); `pull`: each update also
    moves the parameters pull / N of the way back to where worker i computed (--pull)."""
    b = 1 - a * (1 - MU)  # a + b / (1 - mu) = 1 / (1 - mu): the same long-run step
    n = 1 + 2 * workers
    eye = np.eye(n)
    steps, noise = [], []
    for i in range(workers):
        v, held = 1 + i, 1 + workers + i
        step = eye.copy()
        g = h * (eye[0] if fresh else eye[held])  # the gradient where worker i computes
        step[v] = MU * eye[v] + g
        step[0] = eye[0] - (a * g + b * eye[v]) / workers - pull / workers * (eye[0] - eye[held])
        buffers = sum(step[1 + j] for j in range(workers))
        step[held] = step[0] - ahead / workers * buffers / workers  # the reply
        enters = np.zeros(n)  # d(state) / d(g), row by row as above
        enters[v], enters[0] = 1.0, -a / workers
        enters[held] = enters[0] - ahead / workers / workers
        steps.append(step)
        noise.append(enters)
    return steps, noise


def in_turn(steps):
    """The matrix of the updates `steps` applied one after the other."""
    round_map = np.eye(len(steps[0]))
    for step in steps:
        round_map = step @ round_map
    return round_map


def round_with_noise(steps, enters, variance):
    """One round's matrix, and the covariance its N gradients' noise adds to the state by the
    round's end: each gradient carries independent noise of `variance`, entering along its
    `enters` direction and then carried through the updates after it in the round."""
    n = len(steps[0])
    round_map, q = in_turn(steps), np.zeros((n, n))
    for i, e in enumerate(enters):
        for step in steps[i + 1:]:
            e = step @ e
        q += variance * np.outer(e, e)
    return round_map, q


def per_worker_rule(workers, a=1 + MU, ahead=0, fresh=False):
    """One round of N updates of the script's rule, as one matrix (a function of h)."""
    def update(h):
        return in_turn(per_worker_steps(workers, h, a, ahead, fresh)[0])
    return update


def noise_floor(workers, h, a=1 + MU, ahead=0, fresh=False):
    """The stationary variance of the parameters the gradients are computed on, when each
    gradient carries independent noise of N times one process's variance (batch B / N): the
    loss SGD's noise keeps it at along a direction of curvature lambda (h = lr lambda)."""
    steps, enters = per_worker_steps(workers, h, a, ahead, fresh)
    n = 1 + 2 * workers
    round_map, q = round_with_noise(steps, enters, workers)
    if spectral_radius(round_map) >= 1.0:
        return np.inf
    # the fixed point of cov = M cov M^T + q
    cov = np.linalg.solve(np.eye(n * n) - np.kron(round_map, round_map), q.ravel()).reshape(n, n)
    points = [0] if fresh else range(1 + workers, n)
    return float(np.mean([cov[p, p] for p in points]))


def horizon_loss(workers, h, rounds=600, noise=1.0, **rule):
    """E[theta^2] after `rounds` rounds from theta = 1 (buffers 0, every worker holding 1),
    each gradient h (theta_held + xi) with xi of variance N * noise (batch B / N): how far
    SGD has come (bias) and where its noise keeps it (variance), together."""
    steps, enters = per_worker_steps(workers, h, **rule)
    n = len(steps[0])
    round_map, q = round_with_noise(steps, enters, workers * noise * h * h)
    mean, cov = np.zeros(n), np.zeros((n, n))
    mean[0], mean[1 + workers:] = 1.0, 1.0
    for _ in range(rounds):
        mean, cov = round_map @ mean, round_map @ cov @ round_map.T + q
        if cov[0, 0] > 1e12:  # diverged
            return np.inf
    return mean[0] ** 2 + cov[0, 0]


def pull_report(pulls=(0.0, 0.1, 0.2, 0.4, 0.6), hs=np.geomspace(1e-4, 0.6, 16)):
    """The finite-horizon loss relative to one process's, per worker count and pull: its
    geometric mean over the spectrum and over its 4 sharpest directions."""
    one = np.array([horizon_loss(1, h) for h in hs])
    print("The pull (--pull P): the loss after 600 rounds relative to one process's, geometric "
          f"mean over h = {hs[0]:g}..{hs[-1]:g} (16 directions) / over the 4 sharpest "
          f"(h >= {hs[-4]:.2f}):")
    for workers in (2, 4, 8):
        cells = []
        for p in pulls:
            r = np.array([horizon_loss(workers, h, ahead=workers - 1, pull=p) for h in hs]) / one
            cells.append(f"P {p:g}: {np.exp(np.mean(np.log(r))):.3f} "
                         f"/ {np.exp(np.mean(np.log(r[-4:]))):.2f}")
        fresh = np.array([horizon_loss(workers, h, fresh=True) for h in hs]) / one
        print(f"  {workers} workers  " + "   ".join(cells) +
              f"   (nothing stale: {np.exp(np.mean(np.log(fresh))):.3f})")


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
    hs = (0.02, 0.05, 0.1, 0.2, 0.4)
    print("Noise floor: the variance where gradients are computed, relative to one process's, "
          f"at h = {', '.join(map(str, hs))}:")
    one = [noise_floor(1, h) for h in hs]
    for workers in (2, 4, 8):
        for name, rule in (("reply as is (--ahead 0)", dict(ahead=0)),
                           ("extrapolated N - 1 (default)", dict(ahead=workers - 1)),
                           ("extrapolated 2 (N - 1)", dict(ahead=2 * (workers - 1))),
                           ("nothing stale", dict(fresh=True))):
            ratios = [noise_floor(workers, h, **rule) / o for h, o in zip(hs, one)]
            print(f"  {workers} workers, {name:29s}", " ".join(f"{r:5.2f}" for r in ratios))
    # the family's best in the bulk (small h): every split a and extrapolation K, 4 workers
    def bulk(rule):  # the mean log ratio for h <= 0.1
        return np.mean([np.log(noise_floor(4, h, *rule) / o) for h, o in zip(hs[:3], one[:3])])
    grid = [(a, k) for a in (1.0, 1 + MU, 2.5, 3.0) for k in np.linspace(0, 9, 13)]
    a, k = min(grid, key=bulk)
    ratios = [noise_floor(4, h, a, k) / o for h, o in zip(hs, one)]
    print(f"  4 workers, the best split and extrapolation for h <= {hs[2]} (a = {a:.2f}, K = "
          f"{k:.2f}):", " ".join(f"{r:5.2f}" for r in ratios))
    pull_report()


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
