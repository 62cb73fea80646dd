package sparksteward.shim

import scala.util.control.NonFatal

import org.apache.spark.SparkContext
import org.apache.spark.scheduler._
import org.slf4j.LoggerFactory

/** Forwards the driver's application, job and executor events to the driver agent.
 *  Each callback only encodes one line and enqueues it: it never blocks and never throws. */
class StewardListener(agent: AgentProcess, sc: SparkContext) extends SparkListener {
  private val log = LoggerFactory.getLogger("sparksteward.shim")
  val appEnded = new java.util.concurrent.CountDownLatch(1) // the plugin's shutdown waits for app_end

  private def forward(event: String)(line: => String): Unit =
    try agent.send(line, sticky = event == "app_start")
    catch { case NonFatal(e) => log.warn(s"spark-steward could not forward $event: $e") }

  override def onApplicationStart(e: SparkListenerApplicationStart): Unit = forward("app_start") {
    Messages.appStart(e.time, e.appId.getOrElse(sc.applicationId), e.appAttemptId, e.appName, sc.version,
      e.sparkUser)
  }

  override def onApplicationEnd(e: SparkListenerApplicationEnd): Unit = try forward("app_end") {
    Messages.appEnd(e.time, e.exitCode, sc.getCheckpointDir)
  } finally appEnded.countDown()

  override def onJobStart(e: SparkListenerJobStart): Unit = forward("job_start") {
    val props = Option(e.properties)
    def prop(k: String) = props.flatMap(p => Option(p.getProperty(k))).filter(_.nonEmpty)
    val tags = prop("spark.job.tags").toSeq.flatMap(_.split(",")).map(_.trim).filter(_.nonEmpty)
    Messages.jobStart(e.time, e.jobId, prop("spark.jobGroup.id"), tags, prop("spark.job.description"),
      e.stageInfos.size, e.stageIds)
  }

  override def onJobEnd(e: SparkListenerJobEnd): Unit = forward("job_end") {
    // JobFailed is private[spark]: read its `exception` by reflection
    val ok = e.jobResult == JobSucceeded
    val reason = if (ok) None else Some(
      try {
        val exc = e.jobResult.getClass.getMethod("exception").invoke(e.jobResult).asInstanceOf[Throwable]
        Option(exc.getMessage).getOrElse(exc.toString)
      } catch { case NonFatal(_) => String.valueOf(e.jobResult) })
    Messages.jobEnd(e.time, e.jobId, ok, reason)
  }

  override def onExecutorAdded(e: SparkListenerExecutorAdded): Unit = forward("executor_added") {
    Messages.executorAdded(e.time, e.executorId, e.executorInfo.executorHost, e.executorInfo.totalCores)
  }

  override def onExecutorRemoved(e: SparkListenerExecutorRemoved): Unit = forward("executor_removed") {
    Messages.executorRemoved(e.time, e.executorId, e.reason)
  }
}
