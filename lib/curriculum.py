"""
A curriculum over prompt difficulty (curriculum='pass_rate'; issue 58, docs/curriculum.md):
spend samples on the prompts whose groups teach something.

Each train prompt keeps a running pass rate: the share of its G completions that the run's
accuracy function counts right, an exponential moving average over its visits, the newest
weighing NEWEST. An average that forgets, not counts: the policy moves, and a prompt it has
learnt should stop paying for the failures of its first visits. A prompt whose rate is at or
above curriculum_easy (or at or below curriculum_hard) after curriculum_patience visits in a
row retires: too easy (too hard). Its groups would be flat, all right or all wrong, with zero
advantage. It comes back for one visit each time the draw has passed it curriculum_rest times,
so a skill forgotten is seen: a visit that brings its rate between the thresholds makes it
active again.

The draw walks the positions rollout.step_rows draws, a seeded reshuffle of the train set
each epoch, and skips the retired prompts that are not due. An iteration's prompts are then a
function of the pool (rates, streaks, skips, the walk's position), which every rank holds the
same: each rank walks the whole iteration and takes its share, and the pool learns from every
rank's groups (make_batch gathers them). A checkpoint keeps the pool, so a resume walks on as
the run never stopped. With nothing retired the walk draws today's prompts, position for
position.
"""
import torch

from lib.errors import ConfigError

# the newest visit's weight in a prompt's running pass rate: about three visits of memory
NEWEST = 0.5


class Pool:

    def __init__(self, n, cfg, *, start, order, saved=None):
        """The pool of n train prompts, at iteration start: fresh (its walk where
        step_rows' would be) or a checkpoint's tensors (saved, Pool.tensors'). order:
        rollout.epoch_order, the train rows in the order an epoch draws them (passed in:
        lib/ never imports the core)."""
        self.cfg, self.orders, self.walked, self.revisits = cfg, {}, None, 0
        self.order = order
        self.rate = torch.full((n,), float('nan'), dtype=torch.float64)
        self.streak = torch.zeros(n, dtype=torch.long)
        self.skipped = torch.zeros(n, dtype=torch.long)
        self.position, self.it = start * cfg.prompts_per_step, start
        if saved:
            if len(saved['rate']) != n:
                raise ConfigError(
                    f"the checkpoint's curriculum tracks {len(saved['rate'])} train "
                    f"prompts, this run has {n}: resume on the same task")
            self.rate, self.streak, self.skipped = (
                saved[k] for k in ('rate', 'streak', 'skipped'))
            self.position, self.it = int(saved['position']), int(saved['iter'])

    def retired(self, i):
        """+1: prompt i is too easy, -1 too hard, 0 in the draw."""
        streak, patience = int(self.streak[i]), self.cfg.curriculum_patience
        return (streak >= patience) - (streak <= -patience)

    def row_at(self, position):
        """The train row the walk holds at a position (step_rows' order)."""
        n = len(self.rate)
        epoch = position // n
        if epoch not in self.orders:
            self.orders = {epoch: self.order(n, epoch, self.cfg.seed).tolist()}
        return self.orders[epoch][position % n]

    def draw(self, it):
        """Iteration it's prompts, every rank's: [(train row, position)] in rank order.
        The walk is kept for update: it changes nothing until then, so a checkpoint
        taken between the two is the pool before the iteration."""
        assert it == self.it, (it, self.it)
        if self.walked is None:
            self.walked, passes, position = [], {}, self.position
            drawn, self.revisits = 0, 0
            while drawn < self.cfg.prompts_per_step:
                i = self.row_at(position)
                passes[i] = passes.get(i, int(self.skipped[i]))
                # a retired prompt is passed by, until it is due for a visit
                if self.retired(i) and passes[i] < self.cfg.curriculum_rest:
                    passes[i] += 1
                    self.walked.append((i, None))
                else:
                    drawn += 1
                    self.revisits += self.retired(i) != 0
                    self.walked.append((i, position))
                position += 1
        return [(i, p) for i, p in self.walked if p is not None]

    def update(self, right):
        """The iteration's groups, every rank's in draw order: (prompts x G,) bool,
        the completions counted right. Each prompt passed by counts a skip, each one
        drawn a visit; the walk moves on."""
        drawn = self.draw(self.it)
        shares = iter(right.view(len(drawn), -1).double().mean(1).tolist())
        for i, position in self.walked:
            if position is None:
                self.skipped[i] += 1
            else:
                self.visit(i, next(shares))
        self.position += len(self.walked)
        self.it, self.walked = self.it + 1, None

    def visit(self, i, share):
        """A visit to prompt i, `share` of its completions right: its running pass rate
        moves toward share by NEWEST (the first visit sets it), its streak counts the
        visits in a row that left the rate too easy (> 0) or too hard (< 0), and its
        skips start again from 0."""
        rate = self.rate[i].item()
        rate = share if rate != rate else rate + NEWEST * (share - rate)
        streak = int(self.streak[i])
        if rate >= self.cfg.curriculum_easy:
            streak = max(streak, 0) + 1
        elif rate <= self.cfg.curriculum_hard:
            streak = min(streak, 0) - 1
        else:
            streak = 0
        self.rate[i], self.streak[i], self.skipped[i] = rate, streak, 0

    def metrics(self):
        """The pool's sizes for the log: prompts in the draw, too easy, too hard; and
        the prompts of the last iteration that came back from retirement."""
        patience = self.cfg.curriculum_patience
        easy = int((self.streak >= patience).sum())
        hard = int((self.streak <= -patience).sum())
        return {'pool/active': len(self.rate) - easy - hard, 'pool/easy': easy,
                'pool/hard': hard, 'pool/revisits': self.revisits}

    def tensors(self):
        """What a checkpoint keeps (checkpoint.save's curriculum.safetensors)."""
        return dict(rate=self.rate, streak=self.streak, skipped=self.skipped,
                    position=torch.tensor(self.position), iter=torch.tensor(self.it))
