"""Sampler math for rectified-flow models (SD3 / FLUX): the Flow-GRPO SDE step and the CPS step.

Conventions (rectified flow, as in diffusers): sigma = 1 is pure noise, sigma = 0 is data,
    x = (1 - sigma) x0 + sigma eps,   velocity v = eps - x0.
Sampling walks sigma from 1 down to 0, so every step dt = sigma_next - sigma is negative.
The equations used below (Flow-GRPO = Liu et al., arXiv 2505.05470, Sec. 4 and App. A):
  (E1) ODE            dx = v dt
  (E2) SDE, same marginals as (E1):
                      dx = [v + std_dev_t^2 / (2 sigma) (x + (1 - sigma) v)] dt + std_dev_t dw,
                      std_dev_t = noise_level * sqrt(sigma / (1 - sigma))
  (E3) Euler-Maruyama step of (E2): x_next ~ N(mu, std_dev_t^2 |dt|),  mu = x + [ ... ] dt
  (E4) x0_hat = x - sigma v
  (E5) KL of two Gaussians with one std s: |mean - mean_ref|^2 / (2 s^2)
Coefficients-Preserving Sampling (CPS = Wang & Yu 2025, arXiv 2509.05952; the released Flow-GRPO's
sde_type="cps"):
  (E6) x0_hat = x - sigma v,  x1_hat = x + (1 - sigma) v   (predicted data and noise;
       x = (1-sigma) x0_hat + sigma x1_hat)
       x_next ~ N(mu, s^2),  mu = (1 - sigma_next) x0_hat + sqrt(sigma_next^2 - s^2) x1_hat,
       s = sigma_next sin(noise_level pi / 2)
       A DDIM-like step: x_next = (1 - sigma_next) x0_hat + [sqrt(sigma_next^2 - s^2)
       x1_hat + s eps], and the noise in brackets has variance exactly sigma_next^2 when x1_hat is a
       unit Gaussian, so x_next keeps the coefficients (1 - sigma_next, sigma_next) of the forward
       process x = (1 - sigma) x0 + sigma eps at every noise level. The SDE step (E3) compensates
       its noise std_dev_t sqrt|dt| only to first order in dt; the CPS paper traces the grain of
       few-step SDE samples to that excess of noise.
GRPO-Guard's RatioNorm (Wang et al. 2025, arXiv 2510.22319, Eq. 8; the released Flow-GRPO
scripts/train_sd3_GRPO_Guard.py), for the SDE step (E3) with step std s = std_dev_t sqrt|dt|:
  (E7) log r_hat = s (log r + |mu - mu_old|^2 / (2 s^2)),
       log r = log pi(x_next) - log pi_old(x_next)
DPM-Solver++(2M) on the predicted clean sample (Lu et al. 2022, arXiv 2211.01095; the released
DiffusionNFT code's rollout sampler, `solver="dpm2"`, "modified from MixGRPO"): with
alpha = 1 - sigma, the half log-SNR lambda(sigma) = log((1 - sigma) / sigma), sigma = sigmas[j],
sigma' = sigmas[j + 1], h = lambda(sigma') - lambda(sigma),
h0 = lambda(sigma) - lambda(sigmas[j - 1]):
  (E8) x' = (sigma' / sigma) x - alpha' (e^-h - 1) (D0 + D1 / 2),
       D0 = x0_hat_j,  D1 = (h / h0) (x0_hat_j - x0_hat_{j-1}),  x0_hat from (E4)
All math runs in float32 whatever the model dtype: bf16 loses too much precision in the
mean and in the log-density (Flow-GRPO casts to fp32 for the same reason).
"""

import math

import numpy as np
import torch


def _per_sample(x, like: torch.Tensor) -> torch.Tensor:
    """A float, 0-dim or [B] tensor -> float32 [B or 1, 1, ..., 1], broadcasting against `like`."""
    shape = (-1, *[1] * (like.ndim - 1))
    return torch.as_tensor(x, dtype=torch.float32, device=like.device).reshape(shape)


def _mean_non_batch(t: torch.Tensor) -> torch.Tensor:
    """Average over every dimension except the first -> shape [B]."""
    return t.mean(dim=tuple(range(1, t.ndim))) if t.ndim > 1 else t


def sigma_schedule(
    num_steps: int,
    shift: float = 3.0,
    image_seq_len: int | None = None,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
) -> torch.Tensor:
    """The sigma grid (num_steps + 1 values, the last one 0) that the diffusers pipelines sample on.

    SD3 (image_seq_len None): static shift s' = shift s / (1 + (shift - 1) s), the timestep shift of
    the SD3 paper (arXiv 2403.03206, "resolution-dependent shifting"). A larger shift spends more
    steps at high noise. Like FlowMatchEulerDiscreteScheduler(shift).set_timesteps(n), the linspace
    runs from 1 to the *already shifted* smallest training sigma shift(1/1000) and is then shifted
    again; we copy that quirk so that our grid is the pipeline's (last non-zero sigma 0.0089 for
    10 steps at shift 3).
    FLUX (image_seq_len given): exponential time shift s' = e^mu / (e^mu + (1/s - 1)) on
    s = linspace(1, 1/n, n) (what FluxPipeline passes), with mu linear in the number of image tokens
    (FluxPipeline's calculate_shift): bigger images get noisier schedules. `shift` is unused here.
    """

    def static(s):
        return shift * s / (1 + (shift - 1) * s)

    if image_seq_len is None:
        s_end = float(static(np.float32(1 / 1000)))  # diffusers computes this end value in fp32
        s = static(np.linspace(1.0, s_end, num_steps))
    else:
        slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
        mu = base_shift + slope * (image_seq_len - base_seq_len)
        # diffusers shifts in fp32
        s = np.linspace(1.0, 1 / num_steps, num_steps).astype(np.float32)
        s = math.exp(mu) / (math.exp(mu) + (1 / s - 1))
    return torch.cat([torch.as_tensor(s, dtype=torch.float32), torch.zeros(1)])


def static_shift_schedule(num_steps: int, shift: float = 3.0) -> torch.Tensor:
    """The grid of the DanceGRPO / G²RPO code (`sd3_time_shift(shift, linspace(1, 0, T+1))`):
    num_steps + 1 values.

    s' = shift s / (1 + (shift - 1) s) on s = linspace(1, 0, num_steps + 1), the SD3 paper's static
    timestep shift, applied once and ending exactly at 0. It differs from `sigma_schedule` in two
    ways: no diffusers quirk (the pipeline's linspace ends at shift(1/1000) and is shifted again),
    and no resolution-dependent (dynamic) shift for FLUX. T = 16, shift 3: 1, .9783, .9545, .9286,
    .9, .8684, .8333, .7941, .75, ..., .3, .1667, 0, where FluxPipeline at 720 px samples
    sigma_7 = 0.741.
    """
    if shift <= 0:
        raise ValueError(
            f"shift {shift}: the timestep shift must be positive (3 in the released G2RPO code)"
        )
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (shift * s / (1 + (shift - 1) * s)).float()


def ode_step(velocity, sample, sigma, sigma_next) -> torch.Tensor:
    """Euler step of the ODE (E1): x_next = x + (sigma_next - sigma) v. Sigmas: float or per-sample
    [B]."""
    x = sample.float()
    dt = _per_sample(sigma_next, x) - _per_sample(sigma, x)
    return x + dt * velocity.float()


def x0_prediction(velocity, sample, sigma) -> torch.Tensor:
    """Predicted clean sample (E4): x0_hat = x - sigma v
    (from x = (1-sigma) x0 + sigma eps, v = eps - x0)."""
    x = sample.float()
    return x - _per_sample(sigma, x) * velocity.float()


def dpm2_step(velocity, sample, sigmas, j: int, prev_x0=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step j of DPM-Solver++(2M) (E8), the released DiffusionNFT code's rollout sampler. The
    first-order step (D1 = 0) is the Euler step (E1) in exact arithmetic, taken as `ode_step` at the
    first step, the last (sigma' = 0) and after sigma = 1 (lambda = -inf: D1 = 0, as the released
    code gets from log 0); on SD3/FLUX schedules steps 0, 1 and T - 1 are Euler steps. Coefficients
    in float64, as released; x in float32. prev_x0: step j - 1's x0_hat (None at j = 0). Returns
    (x_next, this step's x0_hat), the second passed back at step j + 1."""
    x = sample.float()
    x0_hat = x0_prediction(velocity, x, float(sigmas[j]))
    s, s_next = float(sigmas[j]), float(sigmas[j + 1])
    s_prev = float(sigmas[j - 1]) if j > 0 else 1.0
    if prev_x0 is None or j == 0 or s_next == 0 or s_prev >= 1:
        return ode_step(velocity, x, s, s_next), x0_hat
    lam, lam_next, lam_prev = (math.log((1 - q) / q) for q in (s, s_next, s_prev))
    h, h0 = lam_next - lam, lam - lam_prev
    d1 = (h / h0) * (x0_hat - prev_x0.float())
    coef = (1 - s_next) * (math.exp(-h) - 1.0)
    return (s_next / s) * x - coef * (x0_hat + 0.5 * d1), x0_hat


def sde_step_with_logprob(
    velocity,
    sample,
    sigma,
    sigma_next,
    noise_level,
    prev_sample=None,
    generator=None,
    sigma_max=None,
    sde_type: str = "sde",
):
    """Flow-GRPO's SDE step (E2-E3) -> (prev_sample, log_prob [B], mean, std_dev_t), float32;
    sde_type "cps": `cps_step` (E6). sigma, sigma_next, noise_level: floats or [B] tensors. A given
    prev_sample is only scored (training re-scores a stored step), else drawn with `generator`
    (None, one, or one per sample, as in diffusers). log_prob: the Gaussian log-density averaged
    over the non-batch dims, as Flow-GRPO's code; 0 at noise_level 0 (the Euler step E1)."""
    if sde_type == "cps":  # one Gaussian draw per step too: the type never shifts the noise stream
        return cps_step(velocity, sample, sigma, sigma_next, noise_level, prev_sample, generator)
    if sde_type != "sde":
        raise ValueError(f"sde_type '{sde_type}': expected 'sde' (Flow-GRPO) or 'cps'")
    x, v, sigma, sigma_next, a = _step_inputs(velocity, sample, sigma, sigma_next, noise_level)
    dt = sigma_next - sigma
    # (E2): the diffusion coefficient, infinite at sigma = 1; there Flow-GRPO's code puts sigma_max
    # (the schedule's second sigma) in the denominator, and so do we.
    if sigma_max is None and bool(((sigma == 1) & (a > 0)).any()):
        raise ValueError("noise at sigma == 1 needs sigma_max (the schedule's second sigma)")
    sigma_max = _per_sample(0.0 if sigma_max is None else sigma_max, x)
    std_dev_t = a * torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma)))
    # (E3): the ODE's velocity plus the score term that keeps the noisy chain's marginals the ODE's
    mean = x + (v + std_dev_t**2 / (2 * _nonzero(sigma)) * (x + (1 - sigma) * v)) * dt
    step_std = std_dev_t * torch.sqrt((-dt).clamp_min(0))  # the std of x_next given x

    prev_sample = _sample_if_missing(prev_sample, mean, step_std, generator)
    # prev_sample is detached: the gradient reaches the policy only through mean, i.e. through v
    safe_std = _nonzero(step_std)
    log_prob = (
        -((prev_sample.detach() - mean) ** 2) / (2 * safe_std**2)
        - torch.log(safe_std)
        - 0.5 * math.log(2 * math.pi)
    )
    return prev_sample, _zero_where_deterministic(log_prob, step_std), mean, std_dev_t


def cps_step(velocity, sample, sigma, sigma_next, noise_level, prev_sample=None, generator=None):
    """Coefficients-preserving sampling (E6) and the released code's log-prob of where it lands.

    Arguments and returns as `sde_step_with_logprob`; here std_dev_t IS the step's std s (no |dt|
    factor, and no singularity at sigma = 1). a = noise_level in [0, 1]; a = 1 puts all of
    sigma_next into fresh noise (mean = (1 - sigma_next) x0_hat).

    log_prob is what the released code computes (Flow-GRPO's sd3_sde_with_logprob.py with
    sde_type="cps", and FlowCPS's own): -(x_next - mean)^2 averaged over the non-batch dims, "all
    constants removed". Against the normalised log N(x_next; mean, s^2) it drops
      - the terms -log s - log sqrt(2 pi): they depend on (sigma_next, a) only, never on the policy,
        so they cancel exactly in the log-ratio of one stored step;
      - the factor 1 / (2 s^2): this one does NOT cancel. The ratio the loss sees is
        rho_exact^(2 s^2), and its gradient at rho = 1 is 2 s^2 times the exact policy gradient: a
        per-step weight that is largest at the noisiest steps (a = 0.8, 10 steps, shift 3:
        2 s^2 = 1.67 at sigma_next = 0.960 and 0.14 at sigma_next = 0.278). The clip range then
        bounds the rescaled ratio (the released CPS configs use 1e-5).
    We keep the released convention so that its clip ranges and learning rates transfer;
    tests/test_sampler.py checks the 2 s^2 relation. On-policy the ratio is exactly 1 either way.
    """
    x, v, sigma, sigma_next, a = _step_inputs(velocity, sample, sigma, sigma_next, noise_level)
    x0_hat, x1_hat = x - sigma * v, x + (1 - sigma) * v  # the predicted image and noise
    std_dev_t = sigma_next * torch.sin(a * (math.pi / 2))  # (E6)
    # clamp: a = 1 makes sigma_next^2 - s^2 zero up to rounding, which must not become sqrt(-1e-9)
    kept_noise = torch.sqrt((sigma_next**2 - std_dev_t**2).clamp_min(0))
    mean = (1 - sigma_next) * x0_hat + kept_noise * x1_hat
    # a = 0: (E6) is the Euler step in exact arithmetic; take it bit for bit, as the SDE step does
    mean = torch.where(a > 0, mean, x + (sigma_next - sigma) * v)

    prev_sample = _sample_if_missing(prev_sample, mean, std_dev_t, generator)
    log_prob = -((prev_sample.detach() - mean) ** 2)
    return prev_sample, _zero_where_deterministic(log_prob, std_dev_t), mean, std_dev_t


# ------------------------------------------------------------------- the steps' guards and plumbing
def _step_inputs(velocity, sample, sigma, sigma_next, noise_level):
    """float32 x and v, and the three scalars as per-sample [B (or 1), 1, ...] tensors."""
    x, v = sample.float(), velocity.float()
    return x, v, *(_per_sample(s, x) for s in (sigma, sigma_next, noise_level))


def _nonzero(t):
    """t with its zeros replaced by 1: a divisor that is 0 only where its numerator is 0 too."""
    return torch.where(t > 0, t, 1.0)


def _sample_if_missing(prev_sample, mean, step_std, generator):
    if prev_sample is None:
        # diffusers' draw, as its pipelines draw; imported here, as importing diffusers takes 1.4 s
        from diffusers.utils.torch_utils import randn_tensor

        eps = randn_tensor(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
        prev_sample = mean + step_std * eps
    return prev_sample.float()


def _zero_where_deterministic(log_prob, step_std):
    """Per-sample mean of log_prob [B], and 0 where the step had no noise (a point mass)."""
    return torch.where(step_std.reshape(-1) > 0, _mean_non_batch(log_prob), 0.0)


def ratio_norm(log_ratio, mean, old_mean, std_dev_t, sigma, sigma_next) -> torch.Tensor:
    """GRPO-Guard's normalised log-ratio of one SDE step (E7), per sample -> shape [B].

    Why: the stored action is x_next = mu_old + s eps, so with dmu = mu - mu_old the step's
    log-ratio (a mean over elements, like the log-prob) is
    log r = <eps, dmu> / s - <dmu^2> / (2 s^2). Its second term pulls the mean of log r below 0
    whenever the policy has moved, and its first has a spread |dmu| / s that grows as s shrinks (the
    late, low-noise steps): the ratio sits left of 1 and one clip range fits no step, so the clip
    stops too few of the over-confident positive updates (the paper's diagnosis). Adding the bias
    back leaves <eps, dmu> / s; times s it is <eps, dmu>: zero-mean, with a spread that no longer
    depends on the step's noise. On-policy (mu == mu_old) it is exactly 0 (ratio 1), as without it.
    The bias term is differentiated, as in the released code
    (whose s = mean(std_dev_t) mean(sqrt|dt|) over a batch of one timestep is, per sample, this s).
    log_ratio, sigma, sigma_next: [B]; mean, old_mean: [B, ...]; std_dev_t: what
    sde_step_with_logprob returns for sde_type "sde" (CPS's released log-prob has
    neither 1 / (2 s^2) nor sqrt|dt|: not defined for it).
    """
    s = _per_sample(std_dev_t, log_ratio).reshape(-1) * torch.sqrt((sigma - sigma_next).float())
    # a noise-free step (noise_level 0) has no density: it stays at log r_hat = 0
    safe = torch.where(s > 0, s, 1.0)
    bias = _mean_non_batch((mean.float() - old_mean.float()) ** 2) / (2 * safe**2)
    return (log_ratio + bias) * s


def gaussian_kl(mean, mean_ref, std_dev_t) -> torch.Tensor:
    """KL (E5) between the policy's and the reference's step Gaussians, per sample -> shape [B].

    Both share one std, so KL = |mean - mean_ref|^2 / (2 s^2). Pass the std_dev_t that
    sde_step_with_logprob returns. "sde": the paper's closed form takes the step variance
    s^2 = std_dev_t^2 |dt| and sums over elements; Flow-GRPO's code (and we) average over elements
    and divide by std_dev_t^2 only. Dropping |dt| changes the weight beta gets at each step
    (Flow-GRPO issue #78). "cps": std_dev_t is the step std itself, so this is the exact KL of the
    two step Gaussians (averaged over elements); the released code uses the same expression,
    (mean - mean_ref)^2 / (2 std_dev_t^2), for both types. Undefined where std_dev_t
    is 0 (noise_level 0; CPS at sigma_next = 0), where nothing is trained.
    """
    sq = (mean.float() - mean_ref.float()) ** 2
    return _mean_non_batch(sq) / (2 * _per_sample(std_dev_t, sq).reshape(-1) ** 2)


@torch.no_grad()
def ode_along_paths(velocity, x, paths: list[torch.Tensor], batch_size: int, first_velocity=None):
    """Euler ODE (E1) of every row x[m] along its own decreasing sigma path paths[m] -> (x_0 [M,
    ...] float32, NFE = rows evaluated, calls). Each call of velocity(x [B, ...], sigma [B], rows
    [B] CPU long) advances up to batch_size unfinished rows one step, each at its own sigma, in
    index order; longest paths first, a finished row leaving and a waiting one joining (a
    "staircase"), so calls stay full. first_velocity [M, ...]: v(x[m], paths[m][0]) when the caller
    has it (the SDE step's at that state): every row's first step then costs no call."""
    x = x.float().clone()
    pos = [0] * len(paths)  # steps taken by row m
    first = [m for m, p in enumerate(paths) if len(p) > 1] if first_velocity is not None else []
    if first:
        r = torch.tensor(first, device=x.device)
        s0, s1 = (torch.stack([paths[m][i] for m in first]) for i in (0, 1))
        x[r] = ode_step(first_velocity[r], x[r], s0, s1)
    for m in first:
        pos[m] = 1
    left = [len(p) - 1 - pos[m] for m, p in enumerate(paths)]  # steps still to go
    # longest first
    waiting = sorted((m for m in range(len(paths)) if left[m] > 0), key=lambda m: -left[m])
    active, nfe, calls = [], 0, 0
    while waiting or active:
        take = batch_size - len(active)
        active, waiting = sorted(active + waiting[:take]), waiting[take:]
        rows = torch.tensor(active, dtype=torch.long)
        r = rows.to(x.device)
        sig = torch.stack([paths[m][pos[m]] for m in active])
        sig_next = torch.stack([paths[m][pos[m] + 1] for m in active])
        x[r] = ode_step(velocity(x[r], sig, rows), x[r], sig, sig_next)
        nfe, calls = nfe + len(active), calls + 1
        for m in active:
            pos[m] += 1
        active = [m for m in active if pos[m] < len(paths[m]) - 1]
    return x, nfe, calls
