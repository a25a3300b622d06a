//! Buffers whose contents start on a cache line.
//!
//! The kernels load activations 32 or 64 bytes at a time; from a buffer that
//! starts off a line, every other load (or every one) straddles two lines
//! and costs two. `Vec` promises only the element's alignment, and the
//! system allocator usually hands out large blocks 16 bytes past a line, so
//! the activation buffers the kernels read are these instead: a `Vec` a line
//! longer than asked, used from its first element on a line. Safe code
//! only: the offset is found with `align_offset` and the contents are an
//! ordinary subslice.

use std::ops::{Deref, DerefMut};

/// A cache line, in bytes.
pub const LINE: usize = 64;

/// A growable buffer of `len` elements starting on a cache line (while the
/// element type's alignment divides 64, as for every integer and float
/// type; otherwise, where `align_offset` cannot help, where the `Vec` starts).
#[derive(Debug, Clone, Default)]
pub struct LineVec<T> {
    buf: Vec<T>,
    off: usize,
    len: usize,
}

impl<T: Copy + Default> LineVec<T> {
    /// Spare elements so that one of the first ones starts a line.
    fn pad() -> usize {
        LINE / std::mem::size_of::<T>().max(1)
    }

    /// Empty, with room for `len` elements after a start on a line (the
    /// defaults before it pushed). Nothing pushed after this moves the
    /// buffer, so the offset stays right.
    fn start(&mut self, len: usize) {
        self.buf.clear();
        self.buf.reserve(len + Self::pad());
        let off = self.buf.as_ptr().align_offset(LINE);
        self.off = if off < Self::pad() { off } else { 0 };
        self.buf.resize(self.off, T::default());
        self.len = len;
    }

    /// `len` elements, all `T::default()` (the old contents are dropped; the
    /// memory is kept for the next call).
    pub fn reset(&mut self, len: usize) {
        self.start(len);
        self.buf.resize(self.off + len, T::default());
    }

    /// `len` elements for a caller that writes the ones it reads: those
    /// kept from before are left as they were (no pass over them), any new
    /// ones are `T::default()`. Moves to a larger block, zeroed, only when
    /// the buffer has no room.
    pub fn scratch(&mut self, len: usize) {
        if self.off + len > self.buf.capacity() || self.buf.len() < self.off {
            self.reset(len);
        } else {
            self.buf.resize(self.off + len, T::default());
            self.len = len;
        }
    }

    /// A copy of `x`, on a line (written once: no zeroing first).
    pub fn copy_of(&mut self, x: &[T]) -> &[T] {
        self.start(x.len());
        self.buf.extend_from_slice(x);
        self
    }
}

impl<T> Deref for LineVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.off..self.off + self.len]
    }
}

impl<T> DerefMut for LineVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.off..self.off + self.len]
    }
}

impl<T: PartialEq> PartialEq for LineVec<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contents_start_on_a_line() {
        let mut a = LineVec::<u16>::default();
        let mut b = LineVec::<f32>::default();
        let mut c = LineVec::<i8>::default();
        for len in [0usize, 1, 7, 100, 4096, 33] {
            a.reset(len);
            b.reset(len);
            c.reset(len);
            assert_eq!((a.len(), b.len(), c.len()), (len, len, len));
            assert!(a.iter().all(|&v| v == 0) && b.iter().all(|&v| v == 0.0));
            for p in [
                a.as_ptr() as usize,
                b.as_ptr() as usize,
                c.as_ptr() as usize,
            ] {
                assert_eq!(p % LINE, 0, "{len} elements");
            }
        }
        // scratch keeps what is there, grows with defaults, stays on a line.
        b.reset(8);
        b[7] = 5.0;
        let at = b.as_ptr();
        b.scratch(4);
        b.scratch(8);
        assert_eq!((b.as_ptr(), b[3], b[7]), (at, 0.0, 0.0));
        b[3] = 2.0;
        b.scratch(6);
        assert_eq!(b[3], 2.0);
        b.scratch(5000);
        assert_eq!((b.len(), b.as_ptr() as usize % LINE), (5000, 0));
        let x: Vec<f32> = (0..1000).map(|i| i as f32).collect();
        assert_eq!(b.copy_of(&x[3..]), &x[3..]);
        b[0] = -1.0;
        assert_eq!(b[0], -1.0);
    }
}
