//! Activation buffers kept between uses.
//!
//! A prefill step of 1024 tokens needs buffers of tens to hundreds of MB per
//! layer (DeepSeek V4's queries: 1024 × 64 heads × 512 × 4 bytes = 128 MiB).
//! glibc's malloc hands blocks that large out as fresh `mmap`s and unmaps
//! them when freed (on the engine's worker threads always, whatever
//! `M_MMAP_MAX` says), so every layer paid a page fault and a kernel page
//! clear per 4 KiB of each: a fifth of a 1-thread DeepSeek V4 prefill with
//! the amx kernels. [`zeroed`], [`stale`] and [`copy_of`] take a buffer
//! freed earlier (the smallest that is large enough) where there is one, so
//! a layer's buffers are the previous layer's, already mapped.
//!
//! Only buffers of [`MIN_BYTES`] or more are kept, at most [`MAX_KEPT`],
//! the largest first when there are more: what stays held is about one
//! layer's working set, the peak the step reached anyway.

use std::ops::{Deref, DerefMut};
use std::sync::Mutex;

/// Smaller buffers come and go through malloc (its own free lists serve them).
pub const MIN_BYTES: usize = 1 << 20;
/// Buffers kept at most.
pub const MAX_KEPT: usize = 32;

/// Kept buffers; [`zeroed`], [`stale`] and [`copy_of`] use the process's one.
#[derive(Debug, Default)]
pub struct Pool {
    kept: Mutex<Vec<Vec<f32>>>,
}

static POOL: Pool = Pool::new();

/// An f32 buffer that goes back to its pool when dropped. It derefs to the
/// `Vec<f32>`, so it passes wherever a `&[f32]` or `&mut [f32]` does.
#[derive(Debug)]
pub struct Buf {
    v: Vec<f32>,
    pool: &'static Pool,
}

impl Deref for Buf {
    type Target = Vec<f32>;
    fn deref(&self) -> &Vec<f32> {
        &self.v
    }
}

impl DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut Vec<f32> {
        &mut self.v
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        self.pool.give(std::mem::take(&mut self.v));
    }
}

impl Pool {
    pub const fn new() -> Pool {
        Pool {
            kept: Mutex::new(Vec::new()),
        }
    }

    fn list(&self) -> std::sync::MutexGuard<'_, Vec<Vec<f32>>> {
        // A poisoned lock only means another thread panicked while holding
        // it; the list itself is always whole.
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn give(&self, v: Vec<f32>) {
        if v.capacity() * 4 < MIN_BYTES {
            return;
        }
        let mut kept = self.list();
        kept.push(v);
        if kept.len() > MAX_KEPT {
            // drop the smallest: the large ones are the costly ones to map
            kept.sort_by_key(|v| std::cmp::Reverse(v.capacity()));
            kept.truncate(MAX_KEPT);
        }
    }

    /// A kept vector of capacity `len` or more (the smallest such), with
    /// its old values.
    fn take(&self, len: usize) -> Option<Vec<f32>> {
        if len * 4 < MIN_BYTES {
            return None;
        }
        let mut kept = self.list();
        let best = (0..kept.len())
            .filter(|&i| kept[i].capacity() >= len)
            .min_by_key(|&i| kept[i].capacity())?;
        Some(kept.swap_remove(best))
    }

    /// `len` zeros, in a kept buffer where one is large enough.
    pub fn zeroed(&'static self, len: usize) -> Buf {
        let v = match self.take(len) {
            Some(mut v) => {
                v.clear();
                v.resize(len, 0.0);
                v
            }
            // fresh pages are zero already: no second pass
            None => vec![0.0; len],
        };
        Buf { v, pool: self }
    }

    /// `len` values for a caller that overwrites every one: a kept buffer
    /// with whatever it held (no pass over it), or a new one filled with
    /// NaN, so that a value left unwritten shows up (the tests' tiny models
    /// only ever get new ones).
    pub fn stale(&'static self, len: usize) -> Buf {
        let v = match self.take(len) {
            Some(mut v) => {
                v.truncate(len);
                v.resize(len, f32::NAN);
                v
            }
            None => vec![f32::NAN; len],
        };
        Buf { v, pool: self }
    }

    /// A copy of `x`, in a kept buffer where one is large enough.
    pub fn copy_of(&'static self, x: &[f32]) -> Buf {
        let mut v = self.take(x.len()).unwrap_or_default();
        v.clear();
        v.extend_from_slice(x);
        Buf { v, pool: self }
    }

    /// Bytes held in kept buffers now.
    pub fn kept_bytes(&self) -> usize {
        self.list().iter().map(|v| v.capacity() * 4).sum()
    }
}

/// `len` zeros (see [`Pool::zeroed`]), from the process's pool.
pub fn zeroed(len: usize) -> Buf {
    POOL.zeroed(len)
}

/// `len` values to overwrite (see [`Pool::stale`]), from the process's pool.
pub fn stale(len: usize) -> Buf {
    POOL.stale(len)
}

/// A copy of `x` (see [`Pool::copy_of`]), from the process's pool.
pub fn copy_of(x: &[f32]) -> Buf {
    POOL.copy_of(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_kept_and_reused() {
        let pool: &'static Pool = Box::leak(Box::new(Pool::new()));
        let n = MIN_BYTES; // 4 MiB of f32
        let mut a = pool.zeroed(n);
        a[7] = 3.0;
        let p = a.as_ptr();
        drop(a);
        assert_eq!(pool.kept_bytes(), 4 * n);
        // the same memory again, zeroed, at a smaller length
        let b = pool.zeroed(n / 2);
        assert_eq!(b.as_ptr(), p);
        assert_eq!(b.len(), n / 2);
        assert!(b.iter().all(|&v| v == 0.0));
        assert_eq!(pool.kept_bytes(), 0);
        // b is out, so a copy gets new memory (c stays out to the end)
        let x: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let c = pool.copy_of(&x);
        assert_ne!(c.as_ptr(), p);
        assert_eq!(&c[..], &x[..]);
        drop(b);
        // small buffers are not kept
        drop(pool.zeroed(16));
        assert_eq!(pool.kept_bytes(), 4 * n);
        // the smallest that fits: the 4 MiB one for 2 MiB, not a 8 MiB one
        drop(pool.zeroed(2 * n));
        let d = pool.zeroed(n / 2);
        assert_eq!(d.as_ptr(), p);
        drop(d);
        // stale: a new one is NaN; a kept one keeps its values
        let mut e = pool.stale(n / 2);
        assert_eq!(e.as_ptr(), p);
        assert!(e.iter().all(|&v| v == 0.0), "d was zeroed");
        e[3] = 5.0;
        drop(e);
        let e = pool.stale(n / 4);
        assert_eq!((e.as_ptr(), e.len(), e[3]), (p, n / 4, 5.0));
        drop(e);
        let f = pool.stale(n / 2 + 1);
        assert_eq!(f.as_ptr(), p);
        assert!(
            f[n / 4..].iter().all(|v| v.is_nan()),
            "the part past the last use"
        );
        drop(f);
        assert!(pool.stale(3 * n).iter().all(|v| v.is_nan()));
        // at most MAX_KEPT, the largest kept
        let many: Vec<Buf> = (0..MAX_KEPT + 4).map(|i| pool.zeroed(n / 4 + i)).collect();
        drop(many);
        let kept = pool.list();
        assert_eq!(kept.len(), MAX_KEPT);
        assert!(kept.iter().all(|v| v.capacity() >= n / 4 + 4));
    }
}
