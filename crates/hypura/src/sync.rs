//! The one way Hypura takes a lock. A poisoned lock (a thread panicked while holding it) is
//! taken anyway: every critical section here leaves its data whole between statements (counters,
//! queues, maps of units and models), so the state a panic leaves is one the next holder can
//! use, and one failed request must not stop the server or the readers serving the others. A
//! leaf like `format`: any floor may use it.
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

/// `lock` that takes a poisoned mutex as it is.
pub trait Lock<T> {
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T> Lock<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// `Condvar::wait` that takes a poisoned mutex as it is.
pub fn wait<'a, T>(condvar: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    condvar.wait(guard).unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_taken_with_its_data() {
        let shared = std::sync::Arc::new(Mutex::new(vec![1]));
        let holder = std::sync::Arc::clone(&shared);
        let panicked = std::thread::spawn(move || {
            let mut data = holder.lock().unwrap();
            data.push(2);
            panic!("a request failed while holding the lock");
        })
        .join();
        assert!(panicked.is_err() && shared.is_poisoned());
        assert_eq!(*shared.locked(), vec![1, 2]);
    }
}
