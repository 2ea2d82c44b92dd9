"""Per-peer estimate of communication time, learned from observed transfers.

A transfer of ``B`` bytes to a peer is modelled as ``latency + B / bandwidth``.
:class:`CommTimeEstimator` keeps, for every peer, exponentially weighted sums of
the observed ``(num_bytes, seconds)`` pairs (weight ``alpha`` on the newest
observation) and fits that line to them:

* when the observed message sizes vary enough (coefficient of variation above
  5 %), latency and inverse bandwidth are the weighted least-squares fit;
* when they are (nearly) all the same size -- the usual case, every model
  message has the same length -- the two cannot be told apart, so the latency
  keeps its current value (the prior or an earlier fit) and the inverse
  bandwidth is set so that the line passes through the weighted mean.  The
  estimate for that size is then exactly the EWMA of the observed times, which
  converges to the true transfer time and tracks it when it drifts.

Peers never observed get the prior ``(prior_latency_s, prior_bandwidth_Bps)``,
or a per-peer prior given with :meth:`CommTimeEstimator.set_prior`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CommTimeEstimator"]

# Below this relative spread of message sizes latency and bandwidth are not separable.
_MIN_SIZE_CV = 0.05
# Keep at least this share of the mean time as serialisation so bandwidth stays finite.
_MIN_SERIAL_SHARE = 1e-3


@dataclass
class _LinkFit:
    latency_s: float
    inv_bandwidth: float  # seconds per byte
    weight: float = 0.0
    sum_b: float = 0.0
    sum_bb: float = 0.0
    sum_t: float = 0.0
    sum_bt: float = 0.0


class CommTimeEstimator:
    """EWMA estimate of the transfer time to each peer.

    Parameters
    ----------
    alpha
        Weight of the newest observation, in ``(0, 1]``.
    prior_latency_s
        Latency assumed for a peer before any observation (``>= 0``).
    prior_bandwidth_Bps
        Bandwidth in bytes per second assumed before any observation (``> 0``).
    """

    def __init__(
        self,
        alpha: float = 0.3,
        prior_latency_s: float = 0.05,
        prior_bandwidth_Bps: float = 1.25e7,
    ) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        _check_link(prior_latency_s, prior_bandwidth_Bps, "prior")
        self.alpha = float(alpha)
        self.prior_latency_s = float(prior_latency_s)
        self.prior_bandwidth_Bps = float(prior_bandwidth_Bps)
        self._fits: dict[int, _LinkFit] = {}

    def set_prior(self, peer: int, latency_s: float, bandwidth_Bps: float) -> None:
        """Seed the estimate for ``peer`` (e.g. from a network model); clears its history."""
        _check_link(latency_s, bandwidth_Bps, f"prior for peer {peer}")
        self._fits[peer] = _LinkFit(float(latency_s), 1.0 / float(bandwidth_Bps))

    def observed(self, peer: int) -> bool:
        """Whether at least one transfer to ``peer`` has been observed."""
        fit = self._fits.get(peer)
        return fit is not None and fit.weight > 0.0

    def observe(self, peer: int, num_bytes: int, seconds: float) -> None:
        """Record that ``num_bytes`` bytes to ``peer`` took ``seconds`` seconds."""
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        if not seconds >= 0.0:  # also rejects NaN
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        fit = self._fits.get(peer)
        if fit is None:
            fit = _LinkFit(self.prior_latency_s, 1.0 / self.prior_bandwidth_Bps)
            self._fits[peer] = fit
        b, t = float(num_bytes), float(seconds)
        if fit.weight == 0.0:  # first observation: take it at full weight
            fit.weight, fit.sum_b, fit.sum_bb, fit.sum_t, fit.sum_bt = 1.0, b, b * b, t, b * t
        else:
            keep, a = 1.0 - self.alpha, self.alpha
            fit.weight = keep * fit.weight + a
            fit.sum_b = keep * fit.sum_b + a * b
            fit.sum_bb = keep * fit.sum_bb + a * b * b
            fit.sum_t = keep * fit.sum_t + a * t
            fit.sum_bt = keep * fit.sum_bt + a * b * t
        self._refit(fit)

    def estimate(self, peer: int, num_bytes: int) -> float:
        """Estimated seconds to send ``num_bytes`` bytes to ``peer``."""
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        latency, inv_bw = self._params(peer)
        return latency + num_bytes * inv_bw

    def snapshot(self) -> dict[int, tuple[float, float]]:
        """Shareable view: ``peer -> (latency_s, bandwidth_Bps)`` for every known peer."""
        return {peer: (fit.latency_s, 1.0 / fit.inv_bandwidth) for peer, fit in self._fits.items()}

    def _params(self, peer: int) -> tuple[float, float]:
        fit = self._fits.get(peer)
        if fit is None:
            return self.prior_latency_s, 1.0 / self.prior_bandwidth_Bps
        return fit.latency_s, fit.inv_bandwidth

    @staticmethod
    def _refit(fit: _LinkFit) -> None:
        mean_b = fit.sum_b / fit.weight
        mean_t = fit.sum_t / fit.weight
        var_b = max(fit.sum_bb / fit.weight - mean_b * mean_b, 0.0)
        if mean_b > 0.0 and var_b > (_MIN_SIZE_CV * mean_b) ** 2:
            slope = (fit.sum_bt / fit.weight - mean_b * mean_t) / var_b
            intercept = mean_t - slope * mean_b
            if slope > 0.0 and intercept >= 0.0:
                fit.latency_s, fit.inv_bandwidth = intercept, slope
                return
        if mean_b <= 0.0:  # only empty messages seen: they measure latency alone
            fit.latency_s = mean_t
            return
        # One size only: keep the latency, put the rest on the bandwidth.
        latency = min(fit.latency_s, mean_t * (1.0 - _MIN_SERIAL_SHARE))
        fit.latency_s = latency
        fit.inv_bandwidth = max(mean_t - latency, mean_t * _MIN_SERIAL_SHARE, 1e-12) / mean_b


def _check_link(latency_s: float, bandwidth_Bps: float, what: str) -> None:
    if not latency_s >= 0.0:
        raise ValueError(f"{what}: latency must be >= 0 seconds, got {latency_s}")
    if not bandwidth_Bps > 0.0:
        raise ValueError(f"{what}: bandwidth must be > 0 bytes/s, got {bandwidth_Bps}")
