//! A staged block's work off the runtime: a staged block's device copies (`commit_written`, `prepare_read`)
//! and a persist that is an `msync` may block for milliseconds or more, so the server runs them on a
//! blocking thread, under an owned permit of the region's access guard held across it: the region's
//! deregistration waits for the work, and the runtime's threads never do.

use std::sync::Arc;

use ferry_core::region::by_region;
use ferry_core::{Durability, Error, RegionEntry, Resolved, Result};

/// Runs `work` on `region` under an owned permit: on a blocking thread when `blocking`, else here.
/// Fails with the region's `PermissionDenied` once it is being deregistered.
async fn under_permit(
    region: &Arc<RegionEntry>,
    blocking: bool,
    work: impl FnOnce(&RegionEntry) -> Result<()> + Send + 'static,
) -> Result<()> {
    let permit = region.guard().enter_owned().ok_or_else(|| region.gone())?;
    if !blocking {
        let result = work(region);
        drop(permit);
        return result;
    }
    let region = region.clone();
    tokio::task::spawn_blocking(move || {
        let result = work(&region);
        drop(permit);
        result
    })
    .await
    .map_err(|e| Error::Internal(format!("a staged block's work on a blocking thread panicked: {e}")))?
}

/// The staged block's copy to the device after a peer wrote `r` (a completed write).
pub(crate) async fn commit_written(r: &Resolved) -> Result<()> {
    let (offset, len) = (r.offset as usize, r.len as usize);
    let blocking = r.region.staging_may_block(Durability::Completed);
    under_permit(&r.region, blocking, move |region| {
        region.block().commit_written(offset, len, Durability::Completed)
    })
    .await
}

/// The staged block's copy from the device before a peer reads `r`.
pub(crate) async fn prepare_read(r: &Resolved) -> Result<()> {
    let (offset, len) = (r.offset as usize, r.len as usize);
    let blocking = r.region.staging_may_block(Durability::Completed);
    under_permit(&r.region, blocking, move |region| {
        region.block().prepare_read(offset, len)
    })
    .await
}

/// The staged blocks' copies to the device after a peer wrote `parts`, one batch per region (see
/// `MemoryBlock::commit_written_ranges`): a request of many scattered ranges pays one device
/// submission and one trip to a blocking thread per region, not per range. Every region is committed
/// whatever happened to the others; the first error is returned.
pub(crate) async fn commit_written_parts(parts: &[Resolved]) -> Result<()> {
    let mut result = Ok(());
    for (region, ranges) in by_region(parts) {
        let committed = match region.block().check_intact() {
            Ok(()) => {
                let blocking = region.staging_may_block(Durability::Completed);
                under_permit(&region, blocking, move |region| {
                    region.commit_written_ranges(&ranges, Durability::Completed)
                })
                .await
            }
            Err(e) => Err(e),
        };
        if result.is_ok() {
            result = committed;
        }
    }
    result
}

/// The staged blocks' copies from the device before a peer reads `parts`, one batch per region.
pub(crate) async fn prepare_read_parts(parts: &[Resolved]) -> Result<()> {
    for (region, ranges) in by_region(parts) {
        let blocking = region.staging_may_block(Durability::Completed);
        under_permit(&region, blocking, move |region| region.prepare_read_ranges(&ranges)).await?;
    }
    Ok(())
}

/// Makes the written `parts` persistent when asked, one batch per region (a page written by several
/// parts is flushed once); an `msync` runs on a blocking thread.
pub(crate) async fn persist(parts: &[Resolved], durability: Durability) -> Result<()> {
    if durability != Durability::Persistent {
        return Ok(());
    }
    for (region, ranges) in by_region(parts) {
        let blocking = region.staging_may_block(durability);
        under_permit(&region, blocking, move |region| region.persist(&ranges)).await?;
    }
    Ok(())
}
